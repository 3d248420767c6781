"""The tied head of a residual-rotated model (vqpipe/quant/residual_rotation.py): the embedding's rows
live in the rotated stream, so the head reads y -> Q (gain * Q^T y) of the final norm's output."""

import mlx.core as mx

from ..codec import rotation as rot


class Head:
    """The tied head's input map y -> Q (gain * Q^T y) (plain state: the QuantizedEmbedding stores it)."""

    def __init__(self, gain, rotation):
        self.gain, self.rotation = gain, rotation
        self._cast = {}

    def _gain(self, dtype):
        """The gain in ``dtype``, cast once and evaluated (a cast made inside a compile trace would be
        replayed on every step: docs/decode.md, "Prep kernels")."""
        if self.gain.dtype == dtype:
            return self.gain
        if dtype not in self._cast:
            self._cast[dtype] = self.gain.astype(dtype)
            mx.eval(self._cast[dtype])
        return self._cast[dtype]

    def __call__(self, y):
        return self.rotation.apply(self.rotation.apply_transpose(y) * self._gain(y.dtype))

    def to_state(self):
        rmeta, rarrays = self.rotation.to_state()
        return {"rotation": rmeta}, {"gain": self.gain, **{f"rotation.{k}": v for k, v in rarrays.items()}}

    @classmethod
    def from_state(cls, meta, arrays):
        rarrays = {k[len("rotation."):]: v for k, v in arrays.items() if k.startswith("rotation.")}
        return cls(arrays["gain"], rot.from_state(meta["rotation"], rarrays))
