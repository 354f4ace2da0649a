"""The layer's gates and norms, as jit helpers the fused step's kernels share: the log decay g from the raw gate
input, the q/k inverse L2 norm, and the gated RMSNorm with its output gate."""

import triton
import triton.language as tl


@triton.jit
def _log_decay(a_raw, dt_bias, neg_exp_a_log):
    """g = -exp(A_log) * softplus(a + dt_bias), softplus with vLLM's threshold of 20. log(1 + e) via Kahan's
    log1p (log(u) * e / (u - 1), u = 1 + e rounded): accurate to a few ulps also where e = exp(x) is tiny, where
    the plain log(1 + e) loses all relative precision (g -> 0)."""
    x = a_raw + dt_bias
    e = tl.exp(x)
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return neg_exp_a_log * tl.where(x <= 20.0, log1p, x)


@triton.jit
def _output_gate(z, ACT: tl.constexpr):
    """The gated RMSNorm's output gate of the layer's activation (`gated.ACTIVATIONS`)."""
    if ACT == "silu":
        return z * tl.sigmoid(z)
    return tl.sigmoid(z)


@triton.jit
def _inverse_norm(x):
    """1 / |x| over x's last axis, as vLLM's q/k L2 norm (eps 1e-6 under the root)."""
    return tl.rsqrt(tl.sum(x * x, -1) + 1e-6)


@triton.jit
def _gated_rms_norm(o, w, z, eps, V: tl.constexpr, ACT: tl.constexpr):
    """The gated RMSNorm over o's last axis (V long; w [V]): o rsqrt(mean(o^2) + eps) w gate(z)."""
    rstd = tl.expand_dims(tl.rsqrt(tl.sum(o * o, -1) / V + eps), -1)
    return o * rstd * w * _output_gate(z, ACT)
