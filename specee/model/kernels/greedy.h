// The greedy token of each row of logits (greedy.cpp).
#pragma once
#include <ATen/core/Tensor.h>

// logits [rows, vocab] float32, contiguous -> [rows] int64: each row's first maximum, or -1 where that
// maximum is NaN or infinite
at::Tensor greedy_rows(const at::Tensor& logits);

// logits [rows, vocab] float32, contiguous -> [rows, k] int64: each row's k largest, best first (ties:
// the lower index first; NaN never among them)
at::Tensor top_k_rows(const at::Tensor& logits, int64_t k);

// logits[m, ids[m, j]] = rows[m, j] . x[m] in float32, in place (ids [M, k] int64, rows [M, k, K] and
// x [M, K] float32, contiguous; logits [M, vocab] float32, contiguous): a quantized head's candidates
// rescored exactly, one call where torch took five (quant.py RefinedHead)
at::Tensor rescore_rows(at::Tensor logits, const at::Tensor& ids, const at::Tensor& rows, const at::Tensor& x);

// exit/features.py's exit features of N rows: h_prev, h [N, H] (any float type), the final norm's float32
// weight [H], float32 rows [k, H] (shared) or [N, k, H] -> float32 [N, 3k]
at::Tensor exit_features(const at::Tensor& h_prev, const at::Tensor& h, const at::Tensor& w, double eps,
                         const at::Tensor& rows);
