"""Which draft tokens the target accepts: greedy matching, rejection sampling, and trees.

Every function here stays on the device and returns one small LongTensor that the decode
loop reads once per step (the only host sync of a speculative step):

    verdict = [a, t_0, t_1, ..., t_k]   the step emits t_0..t_a (a accepted drafts + 1 token)

Exactness. With deterministic drafts (greedy, prompt lookup, a tree's top-k children) each
draft is a point mass; speculative sampling's rule min(1, p/q) with q = 1 then accepts d with
probability p(d), and the residual is p without d. Drawing y ~ p at every row and accepting a
draft iff it equals y does exactly that, for chains and for a node's several children alike
(SpecInfer's multi-draft rule with point masses), and under greedy y is the argmax. So the
target's `choices` (one sample per row, `sampling.sample`) decide chains and trees; only a
chain drawn from draft distributions q needs the ratio test (`accept_chain_sampled`).
"""
from __future__ import annotations

import torch

from ..sampling import SamplingParams, probabilities, sample
from .tree import Tree


def accept_chain(draft: torch.Tensor, choices: torch.Tensor) -> torch.Tensor:
    """draft [k]: tokens for rows 1..k; choices [k + 1]: the target's token after each row
    (argmax, or a sample). Accepts while draft == choice; t_j = choices[j]."""
    k = draft.shape[0]
    accepted = torch.cumprod((draft == choices[:k]).long(), dim=0).sum().view(1)
    return torch.cat([accepted, choices])


def accept_chain_sampled(draft: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                         generator: torch.Generator | None) -> torch.Tensor:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for drafts d_j ~ q_j:
    accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from
    norm(max(p_j - q_j, 0)); if all k pass, draw the bonus token from p_k. Every emitted token
    is distributed exactly as the target's p. draft_probs [k, V], target_probs [k + 1, V]."""
    k = draft.shape[0]
    rows = torch.arange(k, device=draft.device)
    p_d, q_d = target_probs[rows, draft], draft_probs[rows, draft]
    u = torch.rand(k, generator=generator, device=draft.device)
    accepted = torch.cumprod((u * q_d < p_d).long(), dim=0).sum().view(1)  # u < p/q, q_d > 0: d was drawn from q
    q_ext = torch.cat([draft_probs, torch.zeros_like(draft_probs[:1])])  # row k: no draft, the residual is p_k
    residual = (target_probs.index_select(0, accepted) - q_ext.index_select(0, accepted)).clamp(min=0)
    total = residual.sum(dim=-1, keepdim=True)
    # p == q up to rounding leaves (almost) nothing: then p itself is the residual's limit
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), target_probs.index_select(0, accepted))
    bonus = torch.multinomial(residual, 1, generator=generator).view(1)
    tokens = torch.cat([draft, bonus]).index_copy(0, accepted, bonus)  # t_j = d_j for j < a, t_a = bonus
    return torch.cat([accepted, tokens])


def verify_chain(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor,
                 params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The verdict for a chain from the target's logits over its rows [r, V] (r - 1 drafts are
    judged: a pass that left early may judge fewer than were drafted): greedy or point-mass drafts
    by matching the target's choices, sampled drafts by speculative sampling."""
    m = logits.shape[0] - 1
    if draft_probs is None or params.greedy:
        return accept_chain(draft_tokens[:m], sample(logits, params, generator))
    return accept_chain_sampled(draft_tokens[:m], draft_probs[:m], probabilities(logits, params), generator)


def accept_tree(tree: Tree, choices: torch.Tensor) -> torch.Tensor:
    """choices [T]: the target's token after each tree row (row 0 = the root). A node is accepted
    when its token equals its parent's choice and its parent is accepted; siblings are distinct
    tokens, so the accepted nodes form one path. Returns [a, node_0..node_D, t_0..t_D]: the
    accepted path's rows from the root (padded past a with the last one), then the tokens emitted
    (path nodes' tokens, then the last node's choice)."""
    match = tree.tokens == choices[tree.parents]
    match[0] = True
    ok = match
    for _ in range(tree.depth):  # acceptance flows down one level per pass
        ok = match & ok[tree.parents]
    best = torch.argmax(torch.where(ok, tree.depths, -1)).view(1)  # deepest accepted node
    chain = [best]
    for _ in range(tree.depth):
        chain.append(tree.parents[chain[-1]])
    path = torch.cat(chain[::-1])  # [D + 1]: root ... best, left-padded with the root
    accepted = tree.depths[best]
    # left-align the path: node j of the accepted path is path[D - a + j]
    shift = torch.arange(tree.depth + 1, device=path.device) + (tree.depth - accepted)
    path = path[shift.clamp(max=tree.depth)]
    tokens = torch.cat([tree.tokens[path[1:]], choices[best]])
    tokens = tokens.index_copy(0, accepted, choices[best])
    return torch.cat([accepted, path, tokens])
