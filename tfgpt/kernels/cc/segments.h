// Packed examples' segment ids, as the causal attention and softmax kernels
// read them: query q of batch row b sees key k when
//   k <= q  and  segment[b, k] == segment[b, q],
// a block-diagonal causal mask. The kernels take the ids as an optional
// input (a list of zero or one int32 (B, S) tensors); without it every key
// k <= q is visible, as if each row were one segment.
//
// `SegmentMask` finds, once per op call, where each query's visible keys
// begin (the first key of its segment), so a kernel works on the keys
// [First(b, q), q] only, and whether all of those are visible (Run(b, q)):
// true for packed rows, whose examples are runs of consecutive positions.
// Where a segment id comes back after another (not something `--pack`
// writes), the keys in between are masked one by one.

#ifndef TFGPT_KERNELS_CC_SEGMENTS_H_
#define TFGPT_KERNELS_CC_SEGMENTS_H_

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "common.h"

#include "absl/strings/str_cat.h"

namespace tfgpt {

// The ops' optional segment-ids input: `segmented` (0 or 1) int32 tensors.
// An attribute's default of 0 keeps graphs written before the input existed
// loadable.
constexpr char kSegmentIdsInput[] = "segment_ids: segmented * int32";
constexpr char kSegmentedAttr[] = "segmented: int >= 0 = 0";

class SegmentMask {
 public:
  SegmentMask() = default;

  // `ids`: the (batch, length) segment ids, row-major.
  SegmentMask(const int32_t* ids, int64_t batch, int64_t length)
      : ids_(ids), length_(length), first_(batch * length), run_(batch * length) {
    std::unordered_map<int32_t, int64_t> first;
    for (int64_t b = 0; b < batch; ++b) {
      first.clear();
      const int32_t* row = ids + b * length;
      for (int64_t s = 0; s < length; ++s) {
        const int64_t index = b * length + s;
        first_[index] = first.emplace(row[s], s).first->second;
        run_[index] = first_[index] == s || (row[s - 1] == row[s] && run_[index - 1]);
      }
    }
  }

  // Whether the op was given segment ids.
  bool segmented() const { return ids_ != nullptr; }

  // The first key query `q` of batch row `b` may see.
  int64_t First(int64_t b, int64_t q) const {
    return ids_ == nullptr ? 0 : first_[b * length_ + q];
  }

  // The first key any query in [begin, end) of batch row `b` may see: the
  // keys before it are masked for the whole block of queries.
  int64_t First(int64_t b, int64_t begin, int64_t end) const {
    int64_t first = end;
    for (int64_t q = begin; q < end && first > 0; ++q) first = std::min(first, First(b, q));
    return first;
  }

  // Whether every key in [First(b, q), q] is visible to query `q`.
  bool Run(int64_t b, int64_t q) const { return ids_ == nullptr || run_[b * length_ + q]; }

  // Whether query `q` of batch row `b` sees key `k` (k <= q assumed).
  bool Sees(int64_t b, int64_t q, int64_t k) const {
    return ids_ == nullptr || ids_[b * length_ + k] == ids_[b * length_ + q];
  }

 private:
  const int32_t* ids_ = nullptr;
  int64_t length_ = 0;
  std::vector<int64_t> first_;
  std::vector<char> run_;
};

// Checks the `segmented` attribute (0 or 1) of an op's constructor.
inline ::tensorflow::Status GetSegmented(OpKernelConstruction* context, bool* segmented) {
  int64_t count;
  TF_RETURN_IF_ERROR(context->GetAttr("segmented", &count));
  if (count > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("segment_ids takes at most one tensor. Received ", count));
  }
  *segmented = count == 1;
  return ::tensorflow::Status();
}

// The mask of the op's optional segment-ids input `index` for (batch, length)
// positions, or an error naming the shape it needs.
inline ::tensorflow::Status ReadSegments(OpKernelContext* context, bool segmented, int index,
                                         int64_t batch, int64_t length, SegmentMask* mask) {
  if (!segmented) {
    *mask = SegmentMask();
    return ::tensorflow::Status();
  }
  const Tensor& ids = context->input(index);
  if (ids.shape() != TensorShape({batch, length})) {
    return absl::InvalidArgumentError(absl::StrCat(
        "segment_ids must be (B, S) = (", batch, ", ", length, "). Received shape ",
        ids.shape().DebugString()));
  }
  *mask = SegmentMask(ids.flat<int32_t>().data(), batch, length);
  return ::tensorflow::Status();
}

}  // namespace tfgpt

#endif  // TFGPT_KERNELS_CC_SEGMENTS_H_
