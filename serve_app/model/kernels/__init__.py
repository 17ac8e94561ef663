"""C and oneDNN kernels: the paged decode attention and the int8 one-row product (C, built once per machine by
`native`), and fp32 linears on oneDNN."""
