"""Answers read as they are written: a JSON or tool-call answer's text and whole calls, in each tool-call format
(`by_format` chooses the reader), from text fed in pieces, in linear time. The engine reads with them to end an
answer at a repeated call and to bound its JSON strings; the HTTP layer, to answer in each API's shape."""
