// The intermediate rows of decode_layer.cpp's layer calls, kept by the calling thread between calls.
#pragma once
#include <ATen/ATen.h>

#include <utility>
#include <vector>

namespace specee_layer {

// Calls of at most this many rows (decode steps, verification passes of 8 requests x 4 rows) keep
// their intermediate rows; a prompt's get new ones, as before: 9 kept buffers of 128 SmolLM2 rows are
// ~4.6 MB, past a core's 2 MB L2, and that prefill ran 0.6-0.9x (glibc hands a freed block straight
// back to the next allocation, so fresh tensors stay in cache).
constexpr int64_t kKeptRows = 32;

// A layer's intermediate rows [S, cols] float32, reused by the calling thread (the engine thread) from
// one layer call to the next: in a steady run of steps the same tensor comes back and nothing is
// allocated (scratch.h says why). Made outside inference mode, whatever the call that first needs it,
// so that a later call outside it may still write into it (an inference tensor refuses in-place ATen ops).
class Buffer {
 public:
  at::Tensor rows(int64_t S, int64_t cols) {
    if (S > kKeptRows) return at::empty({S, cols}, at::kFloat);
    if (!view_.defined() || view_.size(0) != S || view_.size(1) != cols) {
      c10::InferenceMode normal_tensors(false);
      if (storage_.numel() < S * cols) storage_ = at::empty({S * cols}, at::kFloat);
      view_ = storage_.narrow(0, 0, S * cols).view({S, cols});
    }
    return view_;
  }

 private:
  at::Tensor storage_, view_;
};

// Where a segment's K and V rows go (float16 or float32 cache; strides between kv heads), read once a layer call
struct SegmentCache {
  void *k, *v;
  int64_t k_stride, v_stride;
  bool half;
};

// What a layer call's rows pass through: the normed input, q/k/v, rotated queries, attention, the
// MLP's gate/up, activation and down; `hidden`: the two a stack's layers hand each other.
struct Workspace {
  Buffer normed, qkv, queries, attn, gate_up, act, down, hidden[2];
  std::vector<int64_t> firsts;
  std::vector<std::pair<int64_t, int64_t>> alone;
  std::vector<SegmentCache> caches;
};

inline Workspace& workspace() {
  thread_local Workspace ws;
  return ws;
}

}  // namespace specee_layer
