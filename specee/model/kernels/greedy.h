// The greedy token of each row of logits (greedy.cpp).
#pragma once
#include <torch/extension.h>

// logits [rows, vocab] float32, contiguous -> [rows] int64: each row's first maximum, or -1 where that
// maximum is NaN or infinite
at::Tensor greedy_rows(const at::Tensor& logits);

// logits [rows, vocab] float32, contiguous -> [rows, k] int64: each row's k largest, best first (ties:
// the lower index first; NaN never among them)
at::Tensor top_k_rows(const at::Tensor& logits, int64_t k);
