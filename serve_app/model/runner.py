"""ModelRunner: loads a transformers model with our attention and runs one packed forward per step."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from serve_app.config import ModelConfig
from serve_app.kv.storage import KVShape, Storage
from serve_app.kv.view import BatchEntry, KVCacheView
from serve_app.model.attention import attention_window, register_attention, step_context
from serve_app.model.compile_cache import compile_cache_dir
from serve_app.model.compiled import CompiledForward, compile_forward, compile_unsupported
from serve_app.model.kernels.decode_kernel import load_decode_kernel
from serve_app.model.kernels.gguf_matmul import build_gguf_matmul
from serve_app.model.kernels.native import KernelBuildError
from serve_app.model.loader import gguf_origin, resolve_model_path
from serve_app.model.lora import AdapterRows, AdapterSlots, lora_rows, wrap_targets
from serve_app.model.quant.gguf_loading import load_gguf_model
from serve_app.model.quant.int4_loading import load_int4_model
from serve_app.model.quant.quantization import apply_quantization
from serve_app.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _quiet_torchao_import() -> None:
    """transformers imports torchao when it loads any model; torchao then warns that its optional CUDA kernels
    did not load and torch that its enum registration is deprecated: four warnings at every start that no user of
    this server can act on (torchao's own quantization, where asked for, reports its errors as errors)."""
    if "torchao" not in sys.modules:
        logging.getLogger("torchao").setLevel(logging.ERROR)
        logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} asked for, but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass(frozen=True)
class ForwardBatch:
    """One step's packed input: every entry's new tokens, in entry order (decodes first)."""

    entries: Sequence[BatchEntry]
    token_ids: list[int]
    sample_rows: list[int]
    adapter_slots: Sequence[int | None] = ()  # per entry: the LoRA adapter slot its rows run with (None: base)


def _context(hf_config: Any, model: torch.nn.Module, asked: int | None) -> int:
    """The context served: `asked`, else the model's, within its sliding window where it has one."""
    context = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or 2048
    if asked is not None and asked > context:
        raise ValueError(f"max_model_len: {asked} exceeds the model's context of {context} tokens")
    window = attention_window(model)
    if window is not None and (asked or context) > window:
        if asked is not None:
            raise ValueError(
                f"max_model_len: {asked} exceeds the model's sliding_window of {window} tokens (attention here covers "
                "the whole context, which equals sliding-window attention within the window)"
            )
        logger.info("context bounded to the model's sliding_window of %d tokens", window)
        return window
    return asked or context


class ModelRunner:
    """Owns the model, its tokenizer and the facts the cache needs (`kv_shape`, `max_model_len`)."""

    def __init__(self, config: ModelConfig, kv_cache_dtype: str = "auto") -> None:
        """`kv_cache_dtype`: the cache's element type (`CacheConfig.kv_cache_dtype`; auto: the model's dtype)."""
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        self.path = resolve_model_path(config.name, config.cache_dir)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            # Unset, every core (a Serve replica sets it from its Ray CPU reservation: deployments.placement).
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        hf_config = AutoConfig.from_pretrained(self.path)
        self.hf_config = hf_config
        generation = GenerationConfig.from_pretrained(self.path) if (self.path / "generation_config.json").is_file() else None
        eos = getattr(generation, "eos_token_id", None) if generation is not None else None
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.tokenizer = Tokenizer(self.path, extra_eos_token_ids=eos_ids, cache_dir=config.cache_dir)
        _quiet_torchao_import()
        gguf = gguf_origin(config.name)
        # int4 on the CPU builds its 4-bit layers straight from the checkpoint (and the GGUF's blocks).
        self.quantization = self._resolved_quantization(config, gguf)  # what `auto` came to
        int4 = self.quantization == "int4" and self.device.type == "cpu"
        attention = register_attention()
        if self.quantization == "gguf":
            built = self._gguf_model(config, hf_config, attention, gguf)
        else:
            built = load_int4_model(self.path, hf_config, self.dtype, attention, gguf) if int4 else None
        if built is None:
            self.model = AutoModelForCausalLM.from_pretrained(
                self.path, dtype=self.dtype, attn_implementation=attention
            ).to(self.device)
            self.model.eval()
            self.model = apply_quantization(self.model, self.quantization, self.device, config.cache_dir, gguf)
        else:
            self.model = built
        self.max_model_len = _context(hf_config, self.model, config.max_model_len)
        self.adapters: AdapterSlots | None = None  # LoRA adapters, where the config names them or their folder
        if config.serves_adapters:
            layers = wrap_targets(self.model, config.max_num_adapters_per_replica, config.max_lora_rank)
            self.adapters = AdapterSlots(
                config.dynamic_lora_loading_path, layers, config.max_num_adapters_per_replica, config.max_lora_rank,
                config.lora_paths,
            )
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        n_heads = text_config.num_attention_heads
        self.kv_shape = KVShape(
            n_layers=text_config.num_hidden_layers,
            n_kv_heads=getattr(text_config, "num_key_value_heads", None) or n_heads,
            head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // n_heads,
            dtype=self.dtype if kv_cache_dtype == "auto" else _DTYPES[kv_cache_dtype],
        )
        self.vocab_size = int(text_config.vocab_size)
        self.hidden_size = int(text_config.hidden_size)  # an embedding's length
        self.decode_kernel = (
            load_decode_kernel(config.cache_dir, self.device, self.dtype) if config.decode_attention == "auto" else None
        )
        self.model_forward: Callable[..., Any] = self.model  # what a step runs: the model, or its compiled graph
        self.compiled: CompiledForward | None = None  # the compiled forward, once `compile` built it
        self._cache_dir = config.cache_dir
        logger.info("loaded %s on %s (%s, quantization %s)", self.path, self.device, self.dtype, self.quantization)

    def _resolved_quantization(self, config: ModelConfig, gguf: Path | None) -> str:
        """`config.quantization`, with `auto` made `gguf` where the model was made from a GGUF file, runs on the CPU
        in float32 and the block kernel builds here, else `none`."""
        if config.quantization != "auto":
            return config.quantization
        if gguf is None or self.device.type != "cpu" or self.dtype != torch.float32:
            return "none"
        try:
            build_gguf_matmul(config.cache_dir)
        except KernelBuildError as error:
            logger.warning("quantization auto: the float32 weights, since the GGUF block kernel cannot be built: %s", error)
            return "none"
        return "gguf"

    def _gguf_model(self, config: ModelConfig, hf_config: Any, attention: str, gguf: Path | None) -> torch.nn.Module:
        """The model with its GGUF's blocks served as stored (`quantization: gguf`)."""
        if gguf is None or self.device.type != "cpu" or self.dtype != torch.float32:
            raise ValueError(
                "quantization: gguf serves a GGUF file's own blocks, on the CPU in float32; "
                f"{config.name!r} on {self.device} in {self.dtype} is not that (use none, int8 or int4)"
            )
        model = load_gguf_model(self.path, hf_config, attention, gguf, build_gguf_matmul(config.cache_dir))
        if model is None:
            raise ValueError(f"quantization: gguf needs the safetensors checkpoint converted from {gguf}, not in {self.path}")
        return model

    def compile(self, storage: Storage) -> None:
        """Run the forward compiled from now on: compiled (or loaded from torch's compile caches) and
        warmed up here, into `storage`'s first pages. Where it cannot compile, the forward stays eager,
        and one warning says why."""
        reason = compile_unsupported(self.device)
        if reason is None:
            cache_dir = compile_cache_dir(self._cache_dir, self.path, self.dtype, self.quantization, self.device)
            try:
                self.compiled = compile_forward(self.model, storage, self.decode_kernel, cache_dir)
            except Exception as error:  # any failure to compile leaves the eager forward, which works
                reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
            else:
                self.model_forward = self.compiled.forward
                return
        logger.warning("compile: running the eager forward, because the compiled one cannot be built: %s", reason)

    def activation_bytes(self, max_tokens: int, max_rows: int) -> int:
        """An upper estimate of one step's transient memory: a few hidden-sized and the MLP's
        intermediate-sized tensors per packed token, the float32 logits of every sampled row (and a
        copy for sampling), and a fixed reserve for the kernels' workspaces."""
        text_config = self.hf_config.get_text_config() if hasattr(self.hf_config, "get_text_config") else self.hf_config
        element = torch.empty((), dtype=self.dtype).element_size()
        per_token = (8 * text_config.hidden_size + 4 * getattr(text_config, "intermediate_size", 0)) * element
        return max_tokens * per_token + 2 * max_rows * self.vocab_size * 4 + 256 * 2**20

    def rotary(self) -> tuple[str, float | None, torch.Tensor]:
        """The model's RoPE: its type, base (theta) and per-pair inverse frequencies."""
        text_config = self.hf_config.get_text_config() if hasattr(self.hf_config, "get_text_config") else self.hf_config
        parameters = dict(getattr(text_config, "rope_parameters", None) or {})
        inv_freq = next(
            (module.inv_freq for module in self.model.modules() if isinstance(getattr(module, "inv_freq", None), torch.Tensor)),
            None,
        )
        if inv_freq is None:
            raise RuntimeError("the model has no rotary embedding module (inv_freq) to describe")
        theta = parameters.get("rope_theta", getattr(text_config, "rope_theta", None))
        return str(parameters.get("rope_type", "default")), theta, inv_freq.detach().float().cpu()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, view: KVCacheView) -> torch.Tensor:
        """Run the model once over the packed batch; return float32 logits of the `sample_rows` [N, vocab]."""
        positions = [pos for entry in batch.entries for pos in range(entry.start, entry.end)]
        input_ids = torch.tensor([batch.token_ids], dtype=torch.long, device=self.device)
        position_ids = torch.tensor([positions], dtype=torch.long, device=self.device)
        keep = torch.tensor(self._padded(batch.sample_rows), dtype=torch.long, device=self.device)
        with step_context(view, self.decode_kernel), lora_rows(self._adapter_rows(batch)):
            output = self.model_forward(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep)
        return output.logits[0, : len(batch.sample_rows)].float()

    @contextmanager
    def head_inputs(self) -> Iterator[list[torch.Tensor]]:
        """What the LM head is given in the forwards run inside (the final hidden states of the rows it projects,
        [1, rows, hidden] each): the embeddings of those rows."""
        captured: list[torch.Tensor] = []
        head = self.model.get_output_embeddings()
        handle = head.register_forward_pre_hook(lambda _module, args: captured.append(args[0].detach()))
        try:
            yield captured
        finally:
            handle.remove()

    def _padded(self, rows: list[int]) -> list[int]:
        """On the CPU, several sampled rows padded (with the last) to a multiple of 4: MKL's float32 matrix
        multiply takes 2-3x longer for 2 or 3 rows (mod 4) than for 4 on the vocabulary projection (SmolLM2:
        15 and 23 ms against 13 ms for 2, 3 and 4 rows on 2 cores), and 2-5 rows is what a verifying step or
        a small batch samples."""
        if self.device.type != "cpu" or len(rows) < 2 or len(rows) % 4 == 0:
            return rows
        return rows + [rows[-1]] * (-len(rows) % 4)

    def _adapter_rows(self, batch: ForwardBatch) -> AdapterRows | None:
        """The batch's rows of each adapter slot in it."""
        if self.adapters is None:
            return None
        rows: dict[int, list[int]] = {}
        row = 0
        for entry, slot in zip(batch.entries, batch.adapter_slots):
            if slot is not None:
                rows.setdefault(slot, []).extend(range(row, row + entry.num_new))
            row += entry.num_new
        return AdapterRows.of(list(rows.items()), self.device)
