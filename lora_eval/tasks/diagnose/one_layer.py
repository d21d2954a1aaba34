"""A checkpoint's decoder layers one at a time, for `lora-eval diagnose` when a model does not fit twice on a device.

`LayerLoader(model_dir, dtype, device).load(i)` reads the tensors of decoder layer i only, through the family's own
loader and key mapping (renames, per-expert keys, quantized storage), into the family's model with every other
layer a pass-through and the token embedding replaced by a hidden state handed over from elsewhere:
`OneLayer.run(hidden, fwd)` runs layer i on `hidden` [T, H] (one row) and reports its intermediates to `fwd.probe`
as the whole model would (forward.py). Embedding and lm_head are built one vocabulary row wide and read as their
first row only (the family's loader asks for them; the run never uses them), so a layer costs its own weights.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from ...errors import InputError
from ...models import family_and_args
from ...models.checkpoint import TensorFiles, check_finite, read_json
from ...models.layers import Embedding
from ...models.quantized import QuantizedFiles, read_quantization


class LayerLoader:
    """Decoder layers of the checkpoint in `model_dir`, one at a time, in `dtype` on `device`."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype, device: str | torch.device):
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise InputError(model_dir, "model folder not found")
        config_path = model_dir / "config.json"
        config = read_json(config_path)
        self.family, self.args = family_and_args(config, config_path)
        self.quant = read_quantization(config, config_path)
        self.files = TensorFiles.from_checkpoint_dir(model_dir)
        self.dtype, self.device = dtype, torch.device(device)

    @property
    def num_layers(self) -> int:
        return self.args.num_layers

    def load(self, index: int) -> "OneLayer":
        """Decoder layer `index` with its weights read, the layers before it passing their input through."""
        if not 0 <= index < self.args.num_layers:
            raise ValueError(f"layer {index} is not in [0, {self.args.num_layers})")
        args = replace(self.args, vocab_size=1)  # embedding and lm_head one row wide (never run)
        with torch.device("meta"):
            model = self.family.CausalLM(args)
        layers = _decoder_layers(model)
        kept = layers[index]
        _set(model, _name_of(model, layers), nn.ModuleList([PassThrough() for _ in range(index)] + [kept]))
        files = FirstRows(self.files, self.args.vocab_size)
        if self.quant is not None:
            files = QuantizedFiles(files, self.quant, self.dtype, self.device)
        weights = self.family.load_weights(model, files, self.dtype, self.device)
        check_finite(weights, files)  # a NaN / inf named by file and key, as a whole model's load does
        model.load_state_dict(weights, strict=True, assign=True)
        model.inv_freq = model.rope_inv_freq(args.head_dim, args.rope, args.where).to(self.device)
        feed = Given()
        embedding = next(name for name, m in model.named_modules() if isinstance(m, Embedding))
        _set(model, embedding, feed)
        model.eval()
        return OneLayer(model, index, feed)


class OneLayer:
    """One decoder layer (`index`) of a checkpoint, run on a given residual stream."""

    def __init__(self, model: nn.Module, index: int, feed: "Given"):
        self.model, self.index, self.feed = model, index, feed

    @property
    def sites(self) -> set[str]:
        """The module sites (adapter addresses) of this layer."""
        prefix = f"layers.{self.index}."
        return {m.site for m in self.model.modules() if prefix in getattr(m, "site", "")}

    @torch.inference_mode()
    def run(self, hidden: torch.Tensor, fwd) -> torch.Tensor:
        """Layer `index` on `hidden` [T, H] (one row of T positions) -> its output [T, H] (after the final norm, which
        nobody reads: the probe sees the layer's own points)."""
        self.feed.hidden = hidden
        ids = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)  # [1, T]: positions only
        try:
            return self.model(ids, fwd)
        finally:
            self.feed.hidden = None


class PassThrough(nn.Module):
    """A decoder layer that hands its input on unchanged (the layers before the one loaded)."""

    def forward(self, h, cos, sin, fwd):
        return h


class Given(nn.Module):
    """Stands in for the token embedding: returns the hidden state set on it, whatever the ids."""

    hidden: torch.Tensor | None = None

    def forward(self, ids, fwd):
        return self.hidden


class FirstRows:
    """A checkpoint's tensors as the one-layer model's loader sees them: a vocabulary-sized tensor (first dimension
    `vocab`) asked for one row wide is its first row; everything else passes through (TensorFiles' interface)."""

    def __init__(self, files, vocab: int):
        self.files, self.vocab = files, vocab

    @property
    def read_keys(self) -> set[str]:
        return self.files.read_keys

    def _cut(self, key: str, shape) -> bool:
        stored = self.files.shape(key) if key in self.files else None
        return shape is not None and stored is not None and stored[:1] == (self.vocab,) and tuple(shape)[:1] == (1,) \
            and tuple(shape)[1:] == stored[1:]

    def keys(self) -> list[str]:
        return self.files.keys()

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def file_of(self, key: str):
        return self.files.file_of(key)

    def describe(self) -> str:
        return self.files.describe()

    def dtype(self, key: str):
        return self.files.dtype(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.files.shape(key)

    def check(self, key: str, shape: tuple[int, ...]) -> None:
        if not self._cut(key, shape):
            self.files.check(key, shape)

    def get(self, key: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        if not self._cut(key, shape):
            return self.files.get(key, shape, dtype)
        row = self.files.get_rows(key, 0, 1)  # [1, ...]
        return row if dtype is None else row.to(dtype)

    def get_rows(self, key: str, start: int, count: int) -> torch.Tensor:
        return self.files.get_rows(key, start, count)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers (`model.layers`, or `model.language_model.layers`)."""
    return next(m for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and name.endswith("layers"))


def _name_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted `name`."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)
