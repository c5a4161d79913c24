"""``attnkit.capture``: record the attention weights of every attnkit layer in a model."""

from __future__ import annotations

import torch
from torch import nn

from attnkit import functional
from attnkit._validate import AttnkitTypeError, AttnkitValueError
from attnkit.nn import MultiHeadAttention


class Capture:
    """Attention weights recorded while the ``with`` block runs, in call order.

    ``weights[i]`` is ``(B, H, Lq, Lk)`` (detached) from the layer ``names[i]``.
    The model keeps its own kernel and its outputs do not change: each weight
    tensor is recomputed from the layer's projected queries and keys with the
    same mask, by :func:`attnkit.attention_weights`.

    >>> import torch, attnkit
    >>> model = torch.nn.Sequential(attnkit.MultiHeadAttention(16, 4))
    >>> x = torch.randn(1, 5, 16)
    >>> with attnkit.capture(model) as cap:
    ...     _ = model[0](x)
    >>> cap.names, cap.weights[0].shape
    (['0'], torch.Size([1, 4, 5, 5]))
    """

    def __init__(self, model: nn.Module):
        if not isinstance(model, nn.Module):
            raise AttnkitTypeError(f"capture expects a torch.nn.Module, but got {type(model).__name__}.")
        self.layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)]
        self._hf_names = None
        config = getattr(model, "config", None)
        if not self.layers and getattr(config, "_attn_implementation", None) == "attnkit":
            # a HuggingFace model run through attnkit.integrations.transformers
            self._hf_names = {id(m): name for name, m in model.named_modules()}
        elif not self.layers:
            raise AttnkitValueError(
                f"{type(model).__name__} has no attnkit.MultiHeadAttention layer to capture (a HuggingFace "
                "model must be loaded with attn_implementation='attnkit' after "
                "`import attnkit.integrations.transformers`)."
            )
        self.weights: list[torch.Tensor] = []
        self.names: list[str] = []
        self._handles: list = []

    def _hook(self, name: str):
        def hook(module, q, k, v, mask):
            with torch.no_grad():
                self.weights.append(functional.attention_weights(q, k, v, mask).detach())
            self.names.append(name)

        return hook

    def _hf_hook(self, module, q, k, v, mask, mods):
        name = self._hf_names.get(id(module))
        if name is None:  # attention of another model
            return
        kw = {key: mods[key] for key in ("attn_bias", "softcap", "sinks", "scale")}
        with torch.no_grad():
            self.weights.append(functional.attention_weights(q, k, v, mask, **kw).detach())
        self.names.append(name)

    def __enter__(self) -> Capture:
        if self._hf_names is not None:
            from attnkit.integrations.transformers import register_attention_hook

            self._handles.append(register_attention_hook(self._hf_hook))
            return self
        for name, layer in self.layers:
            self._handles.append(layer.register_attention_hook(self._hook(name or type(layer).__name__)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def stack(self, batch: int = 0) -> torch.Tensor:
        """The weights of one sequence as ``(layers, H, Lq, Lk)`` (every call must agree in shape)."""
        if not self.weights:
            raise AttnkitValueError("nothing was captured: run the model inside the with block.")
        shapes = {tuple(w.shape[1:]) for w in self.weights}
        if len(shapes) != 1:
            raise AttnkitValueError(f"captured weights differ in shape {sorted(shapes)}; index cap.weights instead.")
        return torch.stack([w[batch] for w in self.weights])


def capture(model: nn.Module) -> Capture:
    """Record attention weights from every attnkit attention layer inside ``model``.

    ``with attnkit.capture(model) as cap: model(...)``; then ``cap.weights`` and
    ``cap.names``. Outside the block nothing is recorded and no hook remains.
    """
    return Capture(model)
