"""How a checkpoint tensor becomes a parameter: expected source shape and the mapping, per transform."""
import math

import numpy as np


def _prod(s):
    return math.prod(s)


# name -> (source shape for a target shape, function(source, target shape) -> target)
TRANSFORMS = {
    "copy": (lambda t: tuple(t), lambda x, t: x),
    # nn.Linear [out, in] -> [in, out...] (q/k/v/gate/up/down/lm_head; out may split into heads)
    "T": (lambda t: (_prod(t[1:]), t[0]), lambda x, t: np.ascontiguousarray(x.T).reshape(t)),
    # o_proj [D, heads*d] -> [heads, d, D]
    "T_out": (lambda t: (t[-1], _prod(t[:-1])), lambda x, t: np.ascontiguousarray(x.T).reshape(t)),
    # a bias [heads*d] -> [heads, d]
    "reshape": (lambda t: (_prod(t),), lambda x, t: x.reshape(t)),
    # GPT-OSS fused gate_up [..., 2I] with gate in the even and up in the odd columns
    "even_cols": (lambda t: (*t[:-1], 2 * t[-1]), lambda x, t: np.ascontiguousarray(x[..., 0::2])),
    "odd_cols": (lambda t: (*t[:-1], 2 * t[-1]), lambda x, t: np.ascontiguousarray(x[..., 1::2])),
    # DeepSeek's grouped low-rank output wo_a [G*Ro, H*d/G] -> [G, H*d/G, Ro]
    "wo_a": (lambda t: (t[0] * t[2], t[1]), lambda x, t: np.ascontiguousarray(x.reshape(t[0], t[2], t[1]).transpose(0, 2, 1))),
}
