// The greedy token of each row of logits (greedy.cpp).
#pragma once
#include <torch/extension.h>

// logits [rows, vocab] float32, contiguous -> [rows] int64: each row's first maximum, or -1 where that
// maximum is NaN or infinite
at::Tensor greedy_rows(const at::Tensor& logits);
