// Causally masked softmax over the last axis, and its gradient, as single
// fused, multi-threaded CPU kernels.
//
// The attention layer's training path runs
//   cast to float32 -> add a (T, T) bias of 0 / -1e9 -> softmax -> cast back
// as four ops over the (B, H, T, T) scores, with the softmax itself several
// passes and its gradient four more ops. Here each direction is one pass
// per row, in float32 whatever the storage type, over the visible prefix of
// the row only: for T == S that is about half the exponentials and reads.
//
// Row i of a (..., T, S) block sees keys j <= i + (S - T) (queries are the
// last T of S positions, as with a cache prefix of S - T keys):
//   probs_ij = exp(x_ij - m_i) / sum_{j visible} exp(x_ij - m_i)   visible j
//            = 0                                                   otherwise
//   dscores_ij = p_ij (dy_ij - sum_{k visible} dy_ik p_ik)         visible j
//              = 0                                                 otherwise
// S < T would leave the first T - S rows with nothing to attend to; the ops
// reject it instead of inventing a distribution.
//
// With segment ids (packed examples, `segments.h`): scores (B, ..., T, S)
// and ids (B, S); row i is query q = i + (S - T) of batch b, and key j is
// visible when also segment[b, j] == segment[b, q]. Each pass then runs over
// keys [first key of q's segment, q] only.

#include "common.h"
#include "segments.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

namespace tfgpt {

using ::tensorflow::Status;

using FloatRow = Eigen::Map<Eigen::ArrayXf>;
template <typename T>
using ConstRow = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;
template <typename T>
using Row = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;

// `inputs` tensors of one shape (..., T, S), then the optional segment ids
// (B, S).
Status CausalSoftmaxShape(InferenceContext* context, int inputs) {
  ShapeHandle shape;
  TF_RETURN_IF_ERROR(context->WithRankAtLeast(context->input(0), 2, &shape));
  for (int i = 1; i < inputs; ++i) {
    TF_RETURN_IF_ERROR(context->Merge(shape, context->input(i), &shape));
  }
  if (context->num_inputs() > inputs) {
    ShapeHandle segments;
    TF_RETURN_IF_ERROR(context->WithRank(context->input(inputs), 2, &segments));
    TF_RETURN_IF_ERROR(context->WithRankAtLeast(shape, 3, &shape));
    TF_RETURN_IF_ERROR(context->Merge(
        segments, context->MakeShape({context->Dim(shape, 0), context->Dim(shape, -1)}),
        &segments));
  }
  context->set_output(0, shape);
  return Status();
}

REGISTER_OP("TfgptCausalSoftmax")
    .Input("scores: T")
    .Input(kSegmentIdsInput)
    .Output("probs: T")
    .Attr("T: {float, bfloat16, half}")
    .Attr(kSegmentedAttr)
    .SetShapeFn([](InferenceContext* context) { return CausalSoftmaxShape(context, 1); })
    .Doc(R"doc(
Softmax over the last axis of `scores` (..., T, S), S >= T, where row i sees
keys j <= i + (S - T) and every other entry of `probs` is exactly 0. Float32
math, one rounding to T. With `segment_ids` (one int32 (B, S) tensor for
`scores` (B, ..., T, S), or none), row i of batch b sees key j only where
also segment_ids[b, j] == segment_ids[b, i + S - T] (packed examples).
)doc");

REGISTER_OP("TfgptCausalSoftmaxGrad")
    .Input("dprobs: T")
    .Input("probs: T")
    .Input(kSegmentIdsInput)
    .Output("dscores: T")
    .Attr("T: {float, bfloat16, half}")
    .Attr(kSegmentedAttr)
    .SetShapeFn([](InferenceContext* context) { return CausalSoftmaxShape(context, 2); })
    .Doc(R"doc(
Gradient of TfgptCausalSoftmax: p * (dy - sum(dy * p)) over each row's visible
keys, 0 elsewhere. Float32 math, one rounding to T.
)doc");

// The (rows, T, S) view of a (..., T, S) tensor, or an error for one the
// mask does not fit.
Status CheckScores(const TensorShape& shape, int64_t* matrices, int64_t* rows,
                   int64_t* columns) {
  if (shape.dims() < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scores must have rank >= 2 (..., T, S). Received shape ", shape.DebugString()));
  }
  *rows = shape.dim_size(shape.dims() - 2);
  *columns = shape.dim_size(shape.dims() - 1);
  if (*columns < *rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scores (..., T, S) need S >= T: with S < T the first T - S queries would ",
        "see no key. Received shape ", shape.DebugString()));
  }
  const int64_t block = *rows * *columns;
  *matrices = block == 0 ? 0 : shape.num_elements() / block;
  return Status();
}

// The segment mask of a (B, ..., T, S) tensor's op, and the matrices per
// batch row, or an error.
Status CheckSegments(OpKernelContext* context, bool segmented, int index,
                     const TensorShape& shape, int64_t matrices, SegmentMask* segments,
                     int64_t* per_batch) {
  *per_batch = matrices;
  if (!segmented) return ReadSegments(context, false, index, 0, 0, segments);
  if (shape.dims() < 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "with segment_ids, scores must have rank >= 3 (B, ..., T, S). Received shape ",
        shape.DebugString()));
  }
  const int64_t batch = shape.dim_size(0);
  *per_batch = batch == 0 ? 0 : matrices / batch;
  return ReadSegments(context, true, index, batch, shape.dim_size(shape.dims() - 1), segments);
}

// Work unit u -> (matrix, row). Consecutive units pair a short row with a
// long one (0, T-1, 1, T-2, ...), so every block of units costs about the
// same and the thread pool's even split balances even for one matrix.
inline void UnitToRow(int64_t unit, int64_t rows, int64_t* matrix, int64_t* row) {
  *matrix = unit / rows;
  const int64_t k = unit - *matrix * rows;
  *row = (k & 1) ? rows - 1 - k / 2 : k / 2;
}

// Runs fn(begin, end) over blocks of [0, units) on the op's thread pool.
void ForEachRow(OpKernelContext* context, int64_t units, int64_t cost_per_unit,
                const std::function<void(int64_t, int64_t)>& fn) {
  context->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(
      units, cost_per_unit, fn);
}

template <typename T>
class CausalSoftmaxOp : public OpKernel {
 public:
  explicit CausalSoftmaxOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, GetSegmented(context, &segmented_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& input = context->input(0);
    int64_t matrices, rows, columns, per_batch;
    OP_REQUIRES_OK(context, CheckScores(input.shape(), &matrices, &rows, &columns));
    SegmentMask segments;
    OP_REQUIRES_OK(context, CheckSegments(context, segmented_, 1, input.shape(), matrices,
                                          &segments, &per_batch));
    Tensor* output = nullptr;
    OP_REQUIRES_OK(context, context->forward_input_or_allocate_output(
                                {0}, 0, input.shape(), &output));
    if (input.NumElements() == 0) return;
    const T* x = input.flat<T>().data();
    T* y = output->flat<T>().data();
    const int64_t offset = columns - rows;
    // ~ exp (10) + max, sum, scale over the visible half, plus the zero fill.
    const int64_t cost = 8 * columns + 4 * offset + 40;
    ForEachRow(context, matrices * rows, cost, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(std::is_same<T, float>::value ? 0 : columns);
      for (int64_t unit = begin; unit < end; ++unit) {
        int64_t matrix, row;
        UnitToRow(unit, rows, &matrix, &row);
        const int64_t start = (matrix * rows + row) * columns;
        const int64_t query = row + offset, visible = query + 1;
        const int64_t batch = segments.segmented() ? matrix / per_batch : 0;
        const int64_t first = segments.First(batch, query), count = visible - first;
        if (!segments.Run(batch, query)) {
          MaskedRow(x + start, y + start, first, query, batch, segments);
        } else if constexpr (std::is_same<T, float>::value) {
          // In place in the output row (which may be the input's buffer).
          ConstRow<float> in(x + start + first, count);
          FloatRow p(y + start + first, count);
          const float max = in.maxCoeff();
          p = (in - max).exp();
          p *= 1.0f / p.sum();
        } else {
          FloatRow p(scratch.data(), count);
          p = ConstRow<T>(x + start + first, count).template cast<float>();
          const float max = p.maxCoeff();
          p = (p - max).exp();
          Row<T>(y + start + first, count) = (p * (1.0f / p.sum())).template cast<T>();
        }
        std::fill(y + start, y + start + first, T(0.0f));
        std::fill(y + start + visible, y + start + columns, T(0.0f));
      }
    });
  }

 private:
  // A row whose query sees some keys of [first, query] only (a segment id
  // that comes back after another's): one key at a time.
  static void MaskedRow(const T* x, T* y, int64_t first, int64_t query, int64_t batch,
                        const SegmentMask& segments) {
    float max = -std::numeric_limits<float>::infinity();
    for (int64_t key = first; key <= query; ++key) {
      if (segments.Sees(batch, query, key)) max = std::max(max, static_cast<float>(x[key]));
    }
    std::vector<float> p(query + 1 - first, 0.0f);
    float sum = 0.0f;
    for (int64_t key = first; key <= query; ++key) {
      if (segments.Sees(batch, query, key)) {
        p[key - first] = std::exp(static_cast<float>(x[key]) - max);
        sum += p[key - first];
      }
    }
    for (int64_t key = first; key <= query; ++key) y[key] = T(p[key - first] / sum);
  }

  bool segmented_;
};

template <typename T>
class CausalSoftmaxGradOp : public OpKernel {
 public:
  explicit CausalSoftmaxGradOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, GetSegmented(context, &segmented_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& dprobs = context->input(0);
    const Tensor& probs = context->input(1);
    OP_REQUIRES(context, dprobs.shape() == probs.shape(),
                absl::InvalidArgumentError(absl::StrCat(
                    "dprobs and probs must have the same shape: ",
                    dprobs.shape().DebugString(), " vs ", probs.shape().DebugString())));
    int64_t matrices, rows, columns, per_batch;
    OP_REQUIRES_OK(context, CheckScores(probs.shape(), &matrices, &rows, &columns));
    SegmentMask segments;
    OP_REQUIRES_OK(context, CheckSegments(context, segmented_, 2, probs.shape(), matrices,
                                          &segments, &per_batch));
    Tensor* output = nullptr;
    OP_REQUIRES_OK(context, context->forward_input_or_allocate_output(
                                {0, 1}, 0, probs.shape(), &output));
    if (probs.NumElements() == 0) return;
    const T* dy = dprobs.flat<T>().data();
    const T* p = probs.flat<T>().data();
    T* dx = output->flat<T>().data();
    const int64_t offset = columns - rows;
    const int64_t cost = 4 * columns + 4 * offset + 40;
    ForEachRow(context, matrices * rows, cost, [&](int64_t begin, int64_t end) {
      for (int64_t unit = begin; unit < end; ++unit) {
        int64_t matrix, row;
        UnitToRow(unit, rows, &matrix, &row);
        const int64_t start = (matrix * rows + row) * columns;
        const int64_t query = row + offset, visible = query + 1;
        const int64_t batch = segments.segmented() ? matrix / per_batch : 0;
        // Keys of [first, query] the query does not see have p = 0, so
        // their dscores are 0 as well.
        const int64_t first = segments.First(batch, query), count = visible - first;
        // Reads of dy and p finish (the dot product) before dx, which may
        // share a buffer with either, is written.
        auto dy_row = ConstRow<T>(dy + start + first, count).template cast<float>();
        auto p_row = ConstRow<T>(p + start + first, count).template cast<float>();
        const float dot = (dy_row * p_row).sum();
        Row<T>(dx + start + first, count) = (p_row * (dy_row - dot)).template cast<T>();
        std::fill(dx + start, dx + start + first, T(0.0f));
        std::fill(dx + start + visible, dx + start + columns, T(0.0f));
      }
    });
  }

 private:
  bool segmented_;
};

#define REGISTER(T)                                                                \
  REGISTER_KERNEL_BUILDER(                                                         \
      Name("TfgptCausalSoftmax").Device(DEVICE_CPU).TypeConstraint<T>("T"),        \
      CausalSoftmaxOp<T>);                                                         \
  REGISTER_KERNEL_BUILDER(                                                         \
      Name("TfgptCausalSoftmaxGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"),    \
      CausalSoftmaxGradOp<T>);

REGISTER(float)
REGISTER(Eigen::bfloat16)
REGISTER(Eigen::half)
#undef REGISTER

}  // namespace tfgpt
