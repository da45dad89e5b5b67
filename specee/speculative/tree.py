"""EAGLE-2 draft trees: grown by cumulative draft confidence, verified in one target pass.

Growing (Li et al. 2024, "EAGLE-2"): the root's top-k tokens are depth 1; at every further
depth the k most confident nodes so far (the beam) are expanded by the drafter, each into its
top-k children, scored by the sum of log-probabilities along the path. Of all candidates the
`size` most confident become the tree; a child never scores above its parent, so that set is
closed under ancestors. Everything has a fixed shape and stays on the device: no host sync; so
the trees of a step's requests grow together, each tensor with a leading request dimension.

Layout: row 0 is the root (the last committed token, whose K/V the target has not written
yet), rows 1..size the chosen candidates in growing order (parents before children). Row i
sits at RoPE position n + depth(i) and cache slot n + i; it attends to the committed slots < n
and to its own ancestors (`ancestors`). After verification the accepted path's K/V are moved
to consecutive slots (`compact`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model.kv_cache import KVCache
from ..model.llama import Transformer
from ..model.step_inputs import StepInputs


@dataclass(frozen=True)
class TreeShape:
    """depth: draft tokens on the longest path; topk: children per expanded node and beam width;
    size: draft nodes verified (the root not counted)."""

    depth: int
    topk: int
    size: int

    def __post_init__(self) -> None:
        if self.depth < 1 or self.topk < 1:
            raise ValueError(f"a draft tree needs depth >= 1 and topk >= 1, got depth={self.depth} topk={self.topk}")
        if not 1 <= self.size <= self.candidates:
            raise ValueError(f"tree size must be in [1, {self.candidates}] for depth={self.depth} topk={self.topk}, "
                             f"got {self.size}")

    @property
    def candidates(self) -> int:
        return self.topk + (self.depth - 1) * self.topk * self.topk


@dataclass
class Tree:
    tokens: torch.Tensor  # [T] row 0 = the root
    parents: torch.Tensor  # [T] row of each node's parent (the root's is 0)
    depths: torch.Tensor  # [T] root 0
    ancestors: torch.Tensor  # [T, T] bool: row i may read row j (j == i or an ancestor of i)
    depth: int  # deepest level that can be present

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]


class TreeGrower:
    """Grows trees of one shape, the trees of several requests together (every tensor has a leading
    request dimension R; the drafter runs each depth's beam rows of all requests in one call).
    `drafter` is a drafter whose forks (one per request) hold the requests' states:

    drafter.tree_roots(forks, C) -> (logits [R', V'], ids [V'] or None: token id of each column,
        fits [R] bools: the forks with room for C candidate rows, whose logits these are; state)
    drafter.tree_rows(forks, state, parents [R', k], tokens [R', k], depth, slots [R', k],
        visible [R', k, C]) -> (logits [R', k, V'], state)
    where forks are the fitting ones, parents index each fork's rows of the previous call (the root
    call: its row 0), slots are the candidates' indices (0..C-1), visible[r, i, c]: row i of fork r
    reads candidate c; `state` is the drafter's, handed back on the next call.
    """

    def __init__(self, shape: TreeShape, device: torch.device):
        self.shape = shape
        K, D = shape.topk, shape.depth
        level = [torch.full((K,), 1, dtype=torch.long)] + [torch.full((K * K,), d, dtype=torch.long)
                                                           for d in range(2, D + 1)]
        self.cand_depths = torch.cat(level).to(device)
        self.eye = torch.eye(shape.candidates, dtype=torch.bool, device=device)
        self.rows = torch.arange(max(shape.size + 1, shape.topk), device=device)

    def grow(self, roots: torch.Tensor, drafter, forks: list) -> list[Tree | None]:
        """roots: LongTensor [R], each request's last committed token; forks: the requests' forks of
        `drafter`. None for a request whose drafter has no room for the candidates (near the end of its
        context)."""
        K, D, C = self.shape.topk, self.shape.depth, self.shape.candidates
        logits, ids, fits, state = drafter.tree_roots(forks, C)
        grown = [i for i, f in enumerate(fits) if f]
        if not grown:
            return [None] * len(forks)
        if len(grown) < len(forks):
            forks, roots = [forks[i] for i in grown], roots[grown]
        R, device = len(grown), roots.device
        cand_tokens = torch.empty(R, C, dtype=torch.long, device=device)
        cand_scores = torch.empty(R, C, dtype=torch.float32, device=device)
        cand_parents = torch.full((R, C), -1, dtype=torch.long, device=device)
        scores, cols = F.log_softmax(logits.float(), dim=-1).topk(K)  # [R, K]
        cand_tokens[:, :K] = cols if ids is None else ids[cols]
        cand_scores[:, :K] = scores
        ancestors = self.eye.expand(R, C, C).clone()
        beam = self.rows[:K].expand(R, K)
        beam_rows = torch.zeros(R, K, dtype=torch.long, device=device)
        offset = K
        for d in range(1, D):
            visible = ancestors.gather(1, beam[:, :, None].expand(R, K, C))
            logits, state = drafter.tree_rows(forks, state, beam_rows, cand_tokens.gather(1, beam), d, beam, visible)
            lp, cols = F.log_softmax(logits.float(), dim=-1).topk(K, dim=-1)  # [R, K, K]
            new = slice(offset, offset + K * K)
            cand_scores[:, new] = (cand_scores.gather(1, beam)[:, :, None] + lp).flatten(1)
            cand_tokens[:, new] = (cols if ids is None else ids[cols]).flatten(1)
            cand_parents[:, new] = beam.repeat_interleave(K, dim=1)
            ancestors[:, new] |= ancestors.gather(1, cand_parents[:, new, None].expand(R, K * K, C))
            best = cand_scores[:, new].topk(K).indices
            beam, beam_rows = offset + best, best // K
            offset += K * K
        T, size = self.shape.size + 1, self.shape.size
        order = torch.sort(-cand_scores, dim=1, stable=True).indices  # ties: shallower (parent) first
        chosen = order[:, :size].sort(dim=1).values  # growing order: parents before children
        row_of = torch.zeros(R, C, dtype=torch.long, device=device)
        row_of.scatter_(1, chosen, self.rows[1:T].expand(R, size))
        parent_cand = cand_parents.gather(1, chosen)
        node_parents = torch.where(parent_cand < 0, 0, row_of.gather(1, parent_cand.clamp(min=0)))
        tree_anc = torch.zeros(R, T, T, dtype=torch.bool, device=device)
        tree_anc[:, :, 0] = True
        tree_anc[:, 1:, 1:] = ancestors.gather(1, chosen[:, :, None].expand(R, size, C)).gather(
            2, chosen[:, None, :].expand(R, size, size))
        tokens = torch.cat([roots[:, None], cand_tokens.gather(1, chosen)], dim=1)
        parents = torch.cat([self.rows[:1].expand(R, 1), node_parents], dim=1)
        depths = torch.cat([self.rows[:1].expand(R, 1), self.cand_depths[chosen]], dim=1)
        trees: list[Tree | None] = [None] * len(fits)
        for r, i in enumerate(grown):
            trees[i] = Tree(tokens=tokens[r], parents=parents[r], depths=depths[r], ancestors=tree_anc[r], depth=D)
        return trees


def beam_inputs(model: Transformer, n: int, depth: int, slots: torch.Tensor, visible: torch.Tensor) -> StepInputs:
    """A drafter's step over k beam rows of one tree (tokens at depth `depth` past the last of n history
    tokens) at cache slots n + slots, each reading the history and the candidates in `visible` [k, C]."""
    k, C = visible.shape
    mask = torch.cat([visible.new_ones(k, n), visible], dim=1).view(1, 1, k, n + C)
    return model.step_inputs(model.slot_ids[n - 1 + depth].expand(1, k), n + slots, mask, n + C)


def tree_inputs(model: Transformer, tree: Tree, start: int) -> StepInputs:
    """The target's step over the tree rows at slots start..start+T-1 (positions start + depth),
    each reading the committed slots < start and its ancestors."""
    T = tree.rows
    slots = start + torch.arange(T, device=tree.tokens.device)
    prefix = torch.ones(T, start, dtype=torch.bool, device=tree.tokens.device)
    mask = torch.cat([prefix, tree.ancestors], dim=1).view(1, 1, T, start + T)
    return model.step_inputs((start + tree.depths)[None, :], slots, mask, start + T)


def compact(cache: KVCache, start: int, path: torch.Tensor) -> None:
    """Move the K/V of the accepted path's rows (path[j] = tree row, j = 0..a) to consecutive
    slots start..start+a in every layer; later slots are overwritten by the next step."""
    src = start + path
    dst = start + torch.arange(path.shape[0], device=path.device)
    cache.k[:, :, :, dst] = cache.k[:, :, :, src]
    cache.v[:, :, :, dst] = cache.v[:, :, :, src]
    cache.length = start + path.shape[0]
