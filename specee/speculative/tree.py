"""EAGLE-2 draft trees: grown by cumulative draft confidence, verified in one target pass.

Growing (Li et al. 2024, "EAGLE-2"): the root's top-k tokens are depth 1; at every further
depth the k most confident nodes so far (the beam) are expanded by the drafter, each into its
top-k children, scored by the sum of log-probabilities along the path. Of all candidates the
`size` most confident become the tree; a child never scores above its parent, so that set is
closed under ancestors. Everything has a fixed shape and stays on the device: no host sync.

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
from ..model.llama import StepInputs, Transformer


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
    """Grows trees of one shape. `drafter` gives the root's scores and expands beam rows:

    drafter.tree_root(C) -> (logits [1, V'], ids [V'] or None: token id of each column), or None
        when C candidate rows do not fit
    drafter.tree_rows(parents [k], tokens [k], depth, slots [k], visible [k, C]) -> logits [k, V']
        where parents index the rows of the previous call (the root call: row 0), slots are the
        candidates' indices (0..C-1) and visible[r, c]: row r reads candidate c.
    """

    def __init__(self, shape: TreeShape, device: torch.device):
        self.shape = shape
        K, D = shape.topk, shape.depth
        level = [torch.full((K,), 1, dtype=torch.long)] + [torch.full((K * K,), d, dtype=torch.long)
                                                           for d in range(2, D + 1)]
        self.cand_depths = torch.cat(level).to(device)
        self.eye = torch.eye(shape.candidates, dtype=torch.bool, device=device)
        self.rows = torch.arange(max(shape.size + 1, shape.topk), device=device)

    def grow(self, root: torch.Tensor, drafter) -> Tree | None:
        """root: LongTensor [1], the last committed token. None: the drafter has no room for the
        candidates (near the end of its context)."""
        K, D, C = self.shape.topk, self.shape.depth, self.shape.candidates
        device = root.device
        cand_tokens = torch.empty(C, dtype=torch.long, device=device)
        cand_scores = torch.empty(C, dtype=torch.float32, device=device)
        cand_parents = torch.full((C,), -1, dtype=torch.long, device=device)
        root_scores = drafter.tree_root(C)
        if root_scores is None:
            return None
        logits, ids = root_scores
        scores, cols = F.log_softmax(logits.float(), dim=-1)[0].topk(K)
        cand_tokens[:K] = cols if ids is None else ids[cols]
        cand_scores[:K] = scores
        ancestors = self.eye.clone()
        beam, beam_rows = self.rows[:K], torch.zeros(K, dtype=torch.long, device=device)
        offset = K
        for d in range(1, D):
            logits = drafter.tree_rows(beam_rows, cand_tokens[beam], d, beam, ancestors[beam])
            lp, cols = F.log_softmax(logits.float(), dim=-1).topk(K, dim=-1)  # [K, K]
            new = slice(offset, offset + K * K)
            cand_scores[new] = (cand_scores[beam][:, None] + lp).flatten()
            cand_tokens[new] = (cols if ids is None else ids[cols]).flatten()
            cand_parents[new] = beam.repeat_interleave(K)
            ancestors[new] |= ancestors[cand_parents[new]]
            best = cand_scores[new].topk(K).indices
            beam, beam_rows = offset + best, best // K
            offset += K * K
        T = self.shape.size + 1
        order = torch.sort(-cand_scores, stable=True).indices  # ties: shallower (parent) first
        chosen = order[: self.shape.size].sort().values  # growing order: parents before children
        row_of = torch.zeros(C, dtype=torch.long, device=device)
        row_of[chosen] = self.rows[1 : T]
        parent_cand = cand_parents[chosen]
        node_parents = torch.where(parent_cand < 0, 0, row_of[parent_cand.clamp(min=0)])
        tree_anc = torch.zeros(T, T, dtype=torch.bool, device=device)
        tree_anc[:, 0] = True
        tree_anc[1:, 1:] = ancestors[chosen][:, chosen]
        return Tree(tokens=torch.cat([root, cand_tokens[chosen]]),
                    parents=torch.cat([self.rows[:1], node_parents]),
                    depths=torch.cat([self.rows[:1], self.cand_depths[chosen]]),
                    ancestors=tree_anc, depth=D)


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
