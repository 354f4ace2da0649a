"""The per-node serial draft tree in torch, batched over requests: every node's conv window and GDN state from its
parent's, as store_all keeps them (a state per node). The baseline reconstruct is held against on CPU; the Triton
twin of the recurrence is the kernel benchmarks' yardstick (`bench/kernels/serial_baseline.py`), the fp64 ground truth
`kernels.reference`.

Packed like the closed form: `parents [N]` local (-1: the request's start state), `cu_nodes [B + 1]`, and a static
`max_nodes` (the tree's verified block), so the loop runs over local node indices with no host sync: node i of
every request at once, after its parent (parents precede their children).
"""

from __future__ import annotations

import torch


def _local_steps(parents: torch.Tensor, cu_nodes: torch.Tensor, max_nodes: int):
    """Per local index i: (each request's packed node i, clamped; which requests have one; its parent's packed
    index, clamped; which have a parent node rather than the start state)."""
    starts = cu_nodes[:-1].long()
    ends = cu_nodes[1:].long()
    last = max(int(parents.shape[0]) - 1, 0)
    for i in range(max_nodes):
        nodes = starts + i
        live = nodes < ends
        nodes = nodes.clamp(max=last)
        parent = parents.long()[nodes]
        yield nodes, live, (starts + parent).clamp(min=0, max=last), (parent >= 0)[:, None]


def serial_tree_conv(x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     parents: torch.Tensor, cu_nodes: torch.Tensor, max_nodes: int,
                     activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over each request's tree: outputs `[N, D]` in x's dtype (fp32 sums) and every node's
    history after it `[N, D, L]` (fp32). `history [B, D, L]`: each request's start, oldest first, L >= width - 1."""
    width = weight.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    histories = torch.zeros((x.shape[0], *history.shape[1:]), dtype=torch.float32, device=x.device)
    start = history.float()
    for nodes, live, parent, has_parent in _local_steps(parents, cu_nodes, max_nodes):
        before = torch.where(has_parent[..., None], histories[parent], start)
        sequence = torch.cat([before, x[nodes].float()[..., None]], dim=2)
        value = (sequence[..., -width:] * weight.float()).sum(dim=2)
        if bias is not None:
            value = value + bias.float()
        out[nodes[live]] = value[live]
        histories[nodes[live]] = sequence[live][..., 1:]
    if activation == "silu":
        out = torch.nn.functional.silu(out)
    elif activation is not None:
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    return out.to(x.dtype), histories


def serial_tree_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       h0: torch.Tensor, parents: torch.Tensor, cu_nodes: torch.Tensor,
                       max_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule node by node: outputs `[N, HV, V]` and every node's state after its token `[N, HV, V, K]`
    (fp32). q, k `[N, H, K]` (normalised, q scaled), v `[N, HV, V]`, g (log decay) and beta `[N, HV]`, `h0
    [B, HV, V, K]` each request's start state; value head hv reads key head hv // (HV // H)."""
    ratio = v.shape[1] // k.shape[1]
    q, k = (t.float().repeat_interleave(ratio, dim=1) for t in (q, k))
    v, g, beta, start = v.float(), g.float(), beta.float(), h0.float()
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    states = torch.zeros((v.shape[0], *h0.shape[1:]), dtype=torch.float32, device=v.device)
    for nodes, live, parent, has_parent in _local_steps(parents, cu_nodes, max_nodes):
        before = torch.where(has_parent[..., None, None], states[parent], start)
        alpha = torch.exp(g[nodes])
        key, query = k[nodes], q[nodes]
        u = beta[nodes][..., None] * (v[nodes] - alpha[..., None] * torch.einsum("bhvk,bhk->bhv", before, key))
        state = alpha[..., None, None] * before + u[..., None] * key[:, :, None, :]
        out[nodes[live]] = torch.einsum("bhvk,bhk->bhv", state, query)[live]
        states[nodes[live]] = state[live]
    return out, states
