"""LayerDrop: a model that skips each of its layers at random in training (Hugging Face's Wav2Vec2, HuBERT, WavLM
and Data2VecAudio default to `layerdrop=0.1`; BART, Whisper, M2M100 take `encoder_layerdrop`/`decoder_layerdrop`;
torchaudio's wav2vec2 a `layer_drop`). A trial of such a model measures whichever layers the dice kept, so its peak
is not the worst case and moves from trial to trial (a larger micro-batch can read a lower peak): the probe's
plans went past the limit in training. A trial runs every layer (`every_layer`); training keeps the drops, whose
peaks stay at or under the measured one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

NAMES = ("layerdrop", "layer_drop", "encoder_layerdrop", "decoder_layerdrop")  # module and config attributes


def layer_drops(model: nn.Module) -> list[tuple[object, str, float]]:
    """(holder, attribute, probability) of each LayerDrop above 0 in `model`: on its modules, and on the
    configuration objects they hold (transformers' forward reads `self.config.layerdrop`)."""
    found, seen = [], set()
    for module in model.modules():
        for holder in (module, getattr(module, "config", None)):
            if holder is None or id(holder) in seen:
                continue
            seen.add(id(holder))
            for name in NAMES:
                value = getattr(holder, name, None) if name in _names_of(holder) else None
                if isinstance(value, float) and value > 0:
                    found.append((holder, name, value))
    return found


def _names_of(holder: object) -> set[str]:
    """The instance's own attributes (a module's __dict__, a config's): not properties or class defaults."""
    return set(vars(holder)) if hasattr(holder, "__dict__") else set()


@contextlib.contextmanager
def every_layer(model: nn.Module) -> Iterator[None]:
    """Inside, `model` drops no layer (each LayerDrop at 0); put back on leaving."""
    drops = layer_drops(model)
    for holder, name, _ in drops:
        setattr(holder, name, 0.0)
    try:
        yield
    finally:
        for holder, name, value in drops:
            setattr(holder, name, value)


def layer_drop_note(label: str, model: nn.Module) -> str | None:
    """What the probe says of a model with LayerDrop (None without)."""
    drops = layer_drops(model)
    if not drops:
        return None
    holder, name, value = drops[0]
    where = type(holder).__name__
    return (f"{label} skips layers at random in training ({name} {value:g} on {where}): every trial runs all of "
            "them, the worst case, so training's peaks stay at or under the measured ones")
