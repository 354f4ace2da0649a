"""What the GDN step's kernels load and derive per request and per node, written once for the state pass and both
epilogues: a request's indices (`_request_indices`), a node's inputs with their gates and q/k inverse norms
(`_node_inputs`), and the gated RMSNorm with the output gate."""

import triton
import triton.language as tl


@triton.jit
def _before_check(pointer):
    """A load meant to leave before the caller's padding check (`if slot < 0: return`), with the slot's own, so that
    what depends on it waits on one load level: volatile, because LLVM sinks a plain load below the check into the
    one branch that uses it."""
    return tl.load(pointer, volatile=True)


@triton.jit
def _request_indices(state_indices, commit_nodes, cu_nodes, i_b, HAS_COMMIT: tl.constexpr,
                     HAS_NODES: tl.constexpr):
    """Request i_b's (slot, commit node, first node, node count), loaded together ahead of the padding check
    (`_before_check`): the commit node -1 without HAS_COMMIT, the node range 0, 0 without HAS_NODES."""
    slot = tl.load(state_indices + i_b).to(tl.int64)
    commit_node = _before_check(commit_nodes + i_b) if HAS_COMMIT else -1
    bos = 0
    n = 0
    if HAS_NODES:
        bos = _before_check(cu_nodes + i_b)
        n = _before_check(cu_nodes + i_b + 1) - bos
    return slot, commit_node, bos, n


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
def _inverse_norm(x):
    """1 / |x| over x's last axis, as vLLM's q/k L2 norm (eps 1e-6 under the root)."""
    return tl.rsqrt(tl.sum(x * x, -1) + 1e-6)


@triton.jit
def _node_inputs(qkv, a, b, z, node, valid, o_k, o_v, i_h, i_hv, bias, neg_exp_a_log, scale, stride_qkv, stride_a,
                 stride_b, stride_z, stride_zh, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 NODE_TILE: tl.constexpr, KEYS: tl.constexpr, QUERY: tl.constexpr):
    """Packed node `node`'s inputs for value head i_hv (key head i_h), fp32, zeros where not `valid`: (log decay g,
    write gate beta, raw query row, its inverse norm times `scale`, raw key row, its inverse norm, value row,
    output-gate row z). `node` (int64) and `valid` are scalars, the rows [K] / [V] vectors over o_k / o_v; with
    NODE_TILE they are [NB] vectors of nodes and the rows [NB, K] / [NB, V] tiles. KEYS loads the gates, the key
    and the value, QUERY the query and z (what is not loaded is 0.0), in the order a, b, q, k, v, z.
    mixed_qkv's row: q | k | v, H * K, H * K, HV * V."""
    if NODE_TILE:
        row = node[:, None]
        row_ok = valid[:, None]
        cols_k = o_k[None, :]
        cols_v = o_v[None, :]
    else:
        row = node
        row_ok = valid
        cols_k = o_k
        cols_v = o_v
    g = 0.0
    beta = 0.0
    q_row = 0.0
    q_inv = 0.0
    k_row = 0.0
    k_inv = 0.0
    v_row = 0.0
    z_row = 0.0
    if KEYS:
        a_t = tl.load(a + node * stride_a + i_hv, mask=valid, other=0.0).to(tl.float32)
        g = _log_decay(a_t, bias, neg_exp_a_log)
        beta = tl.sigmoid(tl.load(b + node * stride_b + i_hv, mask=valid, other=0.0).to(tl.float32))
    if QUERY:
        q_row = tl.load(qkv + row * stride_qkv + i_h * K + cols_k, mask=row_ok, other=0.0).to(tl.float32)
    if KEYS:
        k_row = tl.load(qkv + row * stride_qkv + H * K + i_h * K + cols_k, mask=row_ok, other=0.0).to(tl.float32)
    if QUERY:
        q_inv = _inverse_norm(q_row) * scale
    if KEYS:
        k_inv = _inverse_norm(k_row)
        v_row = tl.load(qkv + row * stride_qkv + 2 * H * K + i_hv * V + cols_v, mask=row_ok,
                        other=0.0).to(tl.float32)
    if QUERY:
        z_row = tl.load(z + row * stride_z + i_hv * stride_zh + cols_v, mask=row_ok, other=0.0).to(tl.float32)
    return g, beta, q_row, q_inv, k_row, k_inv, v_row, z_row


@triton.jit
def _output_gate(z, ACT: tl.constexpr):
    """The gated RMSNorm's output gate of the layer's activation (`gdn_step.ACTIVATIONS`)."""
    if ACT == "silu":
        return z * tl.sigmoid(z)
    return tl.sigmoid(z)


@triton.jit
def _gated_rms_norm(o, w, z, eps, V: tl.constexpr, ACT: tl.constexpr):
    """The gated RMSNorm over o's last axis (V long; w [V]): o rsqrt(mean(o^2) + eps) w gate(z)."""
    rstd = tl.expand_dims(tl.rsqrt(tl.sum(o * o, -1) / V + eps), -1)
    return o * rstd * w * _output_gate(z, ACT)
