"""SwiGLU MLP, top-k routing, the load-balancing loss and the sparse mixture-of-experts block.

Dimension legend (torchtitan style suffixes): B batch, T sequence, D hidden size,
I intermediate size, N = B·T tokens, E experts, K = top-k, A = N·K assignments.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minillm.config import MiniLLMConfig


class MiniLLMMLP(nn.Module):
    """SwiGLU feed-forward: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (Shazeer 2020).

    silu(z) = z·σ(z). (Not ``sigmoid(1.702·z)``, as one tutorial has it: 1.702 belongs to the
    sigmoid approximation of GELU.)

    Shape:
        x (..., D) -> (..., D).
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def route(
    router_logits_NE: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing as Mixtral: softmax over all E experts in fp32, keep the k largest,
    renormalise the kept weights to sum to 1.

    Args:
        router_logits_NE: (N, E) router logits.
        top_k: K, experts per token.

    Returns:
        (weights_NK float32 summing to 1 per row, ids_NK int64 in descending weight order,
        probs_NE float32 full softmax).
    """
    probs_NE = torch.softmax(router_logits_NE.float(), dim=-1)
    weights_NK, ids_NK = torch.topk(probs_NE, top_k, dim=-1)
    weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
    return weights_NK, ids_NK, probs_NE


def tokens_per_expert(ids_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Count of top-k assignments per expert, (E,) int64; sums to N·K."""
    return torch.bincount(ids_NK.reshape(-1), minlength=num_experts)


def load_balancing_loss(
    router_logits_NE: torch.Tensor, num_experts: int, top_k: int
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss of one MoE layer, without the coefficient.

    ``E · Σ_e f_e · P_e`` with ``f_e = count_e / (N·K)`` the fraction of the N·K top-k
    assignments that went to expert e, and ``P_e`` the mean router probability of e over the
    N tokens (Fedus et al. 2021, eq. 4–6, with f normalised by N·K as in seed 000).

    Normalisation: f sums to 1 and P sums to 1, so perfectly balanced routing
    (f_e = P_e = 1/E) gives exactly **1.0**; total collapse onto one expert gives E.
    Relation to HF: for one layer, HF ``load_balancing_loss_func`` divides counts by N only, so
    its value is exactly ``K ×`` this one; over several layers HF pools the layers' rows before
    multiplying, this function is applied per layer and summed by the model.
    Gradient flows through P_e only (f is a count).

    Args:
        router_logits_NE: (N, E) router logits of one layer.
        num_experts: E.
        top_k: K.

    Returns:
        Scalar float32 tensor (0 for N = 0).
    """
    n = router_logits_NE.shape[0]
    if n == 0:  # no token (a padded batch of pads only): no imbalance to measure
        return router_logits_NE.float().sum() * 0.0
    weights_NK, ids_NK, probs_NE = route(router_logits_NE, top_k)
    f_E = tokens_per_expert(ids_NK, num_experts).to(probs_NE.dtype) / (n * top_k)
    p_E = probs_NE.mean(dim=0)
    return num_experts * torch.sum(f_E * p_E)


class MiniLLMSparseMoeBlock(nn.Module):
    """Top-k mixture of SwiGLU experts with a linear router (Mixtral's sparse MoE block).

    ``gate`` is the router (``nn.Linear(D, E)``, HF's name); ``experts`` is a ``ModuleList`` so
    every expert call is a module call that hooks can see. The forward dispatches tokens: the
    N·K (token, expert) assignments are stably sorted by expert, each expert runs once on just
    its tokens (an expert with no tokens is not called), and the weighted outputs are
    ``index_add``-ed back per token (torchtitan's sort-based dispatch). One host sync per layer
    (the per-expert counts). :meth:`forward_dense_reference` keeps seed 000's "every expert on
    every token" combine as a reference for tests.

    Shape:
        hidden_states (B, T, D) -> (output (B, T, D), router_logits (N, E)).
    """

    def __init__(self, config: MiniLLMConfig) -> None:
        super().__init__()
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MiniLLMMLP(config.hidden_size, config.intermediate_size)
            for _ in range(self.num_experts)
        )

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = hidden_states.shape
        x_ND = hidden_states.reshape(-1, d)
        router_logits_NE = self.gate(x_ND)
        weights_NK, ids_NK, _ = route(router_logits_NE, self.top_k)

        ids_A = ids_NK.reshape(-1)
        order_A = torch.argsort(ids_A, stable=True)
        counts = torch.bincount(ids_A, minlength=self.num_experts).tolist()
        token_A = order_A // self.top_k  # which token each sorted assignment belongs to
        weight_A = weights_NK.reshape(-1)[order_A].to(x_ND.dtype)
        x_AD = x_ND[token_A]

        outputs = []
        for expert, x_chunk in zip(self.experts, x_AD.split(counts), strict=True):
            if x_chunk.shape[0] > 0:
                outputs.append(expert(x_chunk))
        y_AD = torch.cat(outputs) * weight_A[:, None]
        out_ND = torch.zeros_like(x_ND).index_add(0, token_A, y_AD)
        return out_ND.view(b, t, d), router_logits_NE

    def forward_dense_reference(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Seed 000's teaching combine: every expert on every token, weighted by a mask.

        E× the compute of :meth:`forward`; kept as the reference the dispatch is tested
        against. Same shapes and outputs (up to float rounding) as :meth:`forward`.
        """
        b, t, d = hidden_states.shape
        x_ND = hidden_states.reshape(-1, d)
        router_logits_NE = self.gate(x_ND)
        weights_NK, ids_NK, _ = route(router_logits_NE, self.top_k)
        out_ND = torch.zeros_like(x_ND)
        for e, expert in enumerate(self.experts):
            w_N1 = (weights_NK * (ids_NK == e)).sum(dim=-1, keepdim=True).to(x_ND.dtype)
            out_ND = out_ND + expert(x_ND) * w_N1
        return out_ND.view(b, t, d), router_logits_NE

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}"
