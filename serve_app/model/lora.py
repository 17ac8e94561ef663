"""LoRA adapters (PEFT folders: `adapter_config.json` + `adapter_model.safetensors`) applied per row of a
packed batch: base-model rows and rows of different adapters run in the same forward.

Each targeted linear layer of the decoder (`LoRALinear`) holds every adapter slot's `A` and `B`
(zero-padded to the largest rank, the adapter's scale folded into `B`). A step says which rows
belong to which slot (`lora_rows`); each slot's rows get `x A^T B^T` added to the base layer's output,
all the step's adapters in two batched products (their rows grouped per adapter, padded to the largest
group). Under `torch.compile` the delta is an opaque op (`serve_app::lora_delta`) on the slots' weights that
reads the step's rows when it runs, so one graph serves every layer, every mix of adapters and an
adapter loaded after compiling. `AdapterSlots` loads adapters into slots on first use, keeps the most recently
used, and never evicts one that a running request holds.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from serve_app.model.surgery import replace_modules
from serve_app.wire.refusals import EngineOverloadedError, InvalidRequestError

# The decoder's linear layers an adapter may target (Llama, Qwen2/3, Mistral names).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdapterRows:
    """A step's adapter rows, grouped per adapter slot and padded to the largest group: `gather` picks each
    group's rows (padding repeats a row), `valid` the unpadded places, `rows` their batch rows, in that order."""

    slots: torch.Tensor  # [groups]
    gather: torch.Tensor  # [groups * longest]
    valid: torch.Tensor  # [rows with an adapter]: places in the padded groups
    rows: torch.Tensor  # [rows with an adapter]: their rows in the batch
    longest: int

    @classmethod
    def of(cls, groups: Sequence[tuple[int, Sequence[int]]], device: torch.device) -> AdapterRows | None:
        """From (slot, its batch rows) pairs; None when there are none."""
        if not groups:
            return None
        longest = max(len(rows) for _, rows in groups)
        gather, valid, rows = [], [], []
        for index, (_, members) in enumerate(groups):
            gather += [*members, *[members[0]] * (longest - len(members))]
            valid += range(index * longest, index * longest + len(members))
            rows += members
        tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return cls(tensor([slot for slot, _ in groups]), tensor(gather), tensor(valid), tensor(rows), longest)


class _Step(threading.local):
    rows: AdapterRows | None = None


_step = _Step()


@contextmanager
def lora_rows(rows: AdapterRows | None) -> Iterator[None]:
    """Make `rows` the adapter rows of one forward on this thread."""
    _step.rows = rows
    try:
        yield
    finally:
        _step.rows = None


@torch.library.custom_op("serve_app::lora_delta", mutates_args=("out",))
def lora_delta(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
    """The op `torch.compile` sees: add to `out` the current step's deltas of the adapters in `lora_a`/`lora_b`."""
    rows = _step.rows
    if rows is not None:
        add_deltas(x, out, lora_a, lora_b, rows)


@lora_delta.register_fake
def _(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
    return None


def add_deltas(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, rows: AdapterRows) -> None:
    """Add to `y` (a layer's base output for `x`, in place) each adapter row's low-rank delta: `lora_a`
    [slots, rank, in] and `lora_b` [slots, out, rank] hold every slot's adapter."""
    rows_in, rows_out = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
    groups = rows_in.index_select(0, rows.gather).view(len(rows.slots), rows.longest, -1).to(lora_a.dtype)
    hidden = torch.bmm(groups, lora_a.index_select(0, rows.slots).transpose(1, 2))
    delta = torch.bmm(hidden, lora_b.index_select(0, rows.slots).transpose(1, 2))
    delta = delta.reshape(-1, lora_b.shape[1]).index_select(0, rows.valid)
    rows_out.index_add_(0, rows.rows, delta.to(rows_out.dtype))


class LoRALinear(torch.nn.Module):
    """A linear layer plus, on the rows of each adapter in the step, that adapter's low-rank delta."""

    def __init__(self, base: torch.nn.Module, slots: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = int(base.in_features), int(base.out_features)
        weight = getattr(base, "weight", None)
        dtype = weight.dtype if isinstance(weight, torch.Tensor) and weight.is_floating_point() else torch.float32
        device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")
        self.register_buffer("lora_a", torch.zeros(slots, max_rank, self.in_features, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(slots, self.out_features, max_rank, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if torch.compiler.is_compiling():
            torch.ops.serve_app.lora_delta(x, y, self.lora_a, self.lora_b)
        elif _step.rows is not None:
            add_deltas(x, y, self.lora_a, self.lora_b, _step.rows)
        return y

    def load(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Write an adapter's `A` [r, in] and scaled `B` [out, r] into `slot` (zero past its rank)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.lora_a[slot, : a.shape[0]].copy_(a)
        self.lora_b[slot, :, : b.shape[1]].copy_(b)


def wrap_targets(model: torch.nn.Module, slots: int, max_rank: int) -> dict[str, LoRALinear]:
    """Put a LoRALinear around every targetable linear layer of `model`; return them by module path."""
    wrapped: dict[str, LoRALinear] = {}

    def wrap(path: str, child: torch.nn.Module) -> LoRALinear | None:
        if path.rpartition(".")[2] not in TARGETS or not (hasattr(child, "in_features") and hasattr(child, "out_features")):
            return None
        wrapped[path] = LoRALinear(child, slots, max_rank)
        return wrapped[path]

    replace_modules(model, wrap)
    return wrapped


@dataclass(frozen=True)
class Adapter:
    """A checked adapter: its rank, and per targeted layer its `A` and `B` with the scale folded in."""

    name: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(name: str, folder: Path, layers: dict[str, LoRALinear], max_rank: int) -> Adapter:
    """The adapter in `folder`, checked against the model's layers; InvalidRequestError naming it and why not."""
    from safetensors.torch import load_file

    def refuse(reason: str) -> InvalidRequestError:
        return InvalidRequestError("lora", f"adapter {name!r}: {reason}")

    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise refuse(f"no PEFT adapter (adapter_config.json and adapter_model.safetensors) in {folder}")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise refuse(f"adapter_config.json is not JSON ({error})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"a {config.get('peft_type')} adapter; only LoRA adapters are served")
    for field, plain in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if config.get(field, plain) not in (plain, None):
            raise refuse(f"{field}={config[field]!r} is not supported")
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    if rank > max_rank:
        raise refuse(f"rank {rank} is over max_lora_rank={max_rank}")
    scale = alpha / (rank**0.5 if config.get("use_rslora") else rank)
    tensors = load_file(str(weights_path))
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        path = key.removeprefix(_PEFT_PREFIX).removesuffix(".lora_A.weight")
        layer = layers.get(path)
        if layer is None:
            raise refuse(f"it targets {path}, which this model has no LoRA-capable layer at")
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise refuse(f"{path} has lora_A but no lora_B")
        if a.shape != (rank, layer.in_features) or b.shape != (layer.out_features, rank):
            raise refuse(
                f"{path}: shapes {tuple(a.shape)} and {tuple(b.shape)} do not fit this model's layer "
                f"({layer.in_features} in, {layer.out_features} out, rank {rank}): an adapter of another base model?"
            )
        weights[path] = (a, b * scale)
    if not weights:
        raise refuse("its safetensors hold no lora_A/lora_B weights")
    return Adapter(name, rank, weights)


class AdapterSlots:
    """Which adapter sits in which slot: loaded on first use from its named folder (`paths`), else from
    `folder/<name>`; most recently used kept, a slot held by running requests never given to another adapter."""

    def __init__(
        self,
        folder: Path | None,
        layers: dict[str, LoRALinear],
        slots: int,
        max_rank: int,
        paths: dict[str, Path] | None = None,
    ) -> None:
        self.folder = folder
        self.paths = dict(paths or {})
        self.layers = layers
        self.max_rank = max_rank
        self.slots = slots
        self._where: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recently used first
        self._holders = [0] * slots
        self._lock = threading.Lock()
        self.loads = 0  # adapters read from disk so far

    def available(self) -> list[str]:
        """The named adapters and those under the folder (each a subfolder with an adapter_config.json)."""
        found = set(self.paths)
        if self.folder is not None and self.folder.is_dir():
            found |= {p.name for p in self.folder.iterdir() if (p / "adapter_config.json").is_file() and _NAME.match(p.name)}
        return sorted(found)

    def loaded(self) -> list[str]:
        with self._lock:
            return list(self._where)

    def acquire(self, name: str) -> int:
        """The slot holding adapter `name`, loaded into one if needed; the caller holds it until `release`.
        InvalidRequestError for a bad adapter; EngineOverloadedError when every slot is held."""
        if not _NAME.match(name):
            raise InvalidRequestError("lora", f"adapter {name!r}: not a valid adapter name")
        with self._lock:
            slot = self._where.get(name)
            if slot is not None:
                self._where.move_to_end(name)
                self._holders[slot] += 1
                return slot
        path = self.paths.get(name) or (self.folder / name if self.folder is not None else None)
        if path is None:
            raise InvalidRequestError("lora", f"adapter {name!r}: no such adapter; known: {', '.join(self.paths)}")
        adapter = read_adapter(name, path, self.layers, self.max_rank)  # off the lock: disk
        with self._lock:
            slot = self._where.get(name)
            if slot is None:
                slot = self._free_slot()
                for path, (a, b) in adapter.weights.items():
                    self.layers[path].load(slot, a, b)
                for path, layer in self.layers.items():
                    if path not in adapter.weights:
                        layer.load(slot, torch.zeros(0, layer.in_features), torch.zeros(layer.out_features, 0))
                self._where[name] = slot
                self.loads += 1
            self._where.move_to_end(name)
            self._holders[slot] += 1
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            self._holders[slot] -= 1

    def _free_slot(self) -> int:
        """An empty slot, else the least recently used one nobody holds (its adapter unloaded)."""
        taken = set(self._where.values())
        for slot in range(self.slots):
            if slot not in taken:
                return slot
        for name, slot in self._where.items():
            if self._holders[slot] == 0:
                del self._where[name]
                return slot
        raise EngineOverloadedError(f"all {self.slots} adapter slots are held by running requests (max_loras)")
