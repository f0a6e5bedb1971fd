// Causal multi-head self-attention of a fused query/key/value projection,
// forward and backward, in float32, skipping the masked blocks.
//
// The attention layer's training path otherwise runs: transpose the
// (B, T, 3, H, D) projection to (3, B, H, T, D), scale the queries, one
// batched matmul for the (B, H, T, T) scores, the causal softmax, a second
// batched matmul, and a transpose back to (B, T, H, D); the gradient runs
// the mirror image plus a pack of dq, dk, dv. Half of each batched matmul
// computes scores the mask then throws away.
//
// Here one op reads the heads straight out of the projection (B, T, 3C)
// with strides and writes the heads' outputs straight into (B, T, C). Per
// (batch, head), queries are taken in blocks of `block_size` rows; block i
// (rows [r0, r1)) only meets keys [0, r1):
//   scores  = Q[r0:r1] K[0:r1]^T                      (rows x r1)
//   weights = causal softmax(scores / sqrt(D))         row r sees keys <= r
//   out[r0:r1] = weights V[0:r1]
// so the matmuls do (n + 1) / (2 n) of the full work for n blocks. The
// softmax runs on each block while it is in cache. The weights are kept for
// the gradient in a packed block-lower layout: per (batch, head), block i's
// rows x r1 matrix after block i - 1's, L = sum_i rows_i * r1_i floats.
//
// With segment ids (packed examples, `segments.h`), query q also sees only
// the keys of its own segment: row r's softmax runs over keys
// [first key of its segment, r], and block i meets keys [c0, r1) only, c0
// the first key any of its queries sees; the weights keep their layout,
// with zeros before c0. A row of one segment computes what it computes
// without segment ids, bit for bit.
//
// Gradient, per (batch, head) and block, with dO the output gradient:
//   dV[c0:r1] += weights^T dO[r0:r1]
//   dP         = dO[r0:r1] V[c0:r1]^T
//   dS         = weights * (dP - rowsum(weights * dP)) / sqrt(D)
//   dQ[r0:r1]  = dS K[c0:r1],   dK[c0:r1] += dS^T Q[r0:r1]
// (c0 = 0 without segment ids).
// Each (batch, head) is one unit of work done in a fixed order, so results
// do not depend on the thread pool. The matmuls are Eigen's (single
// threaded per unit; the units spread over the op's threads).

#include "common.h"
#include "segments.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tfgpt {
namespace {

using ::tensorflow::Status;

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Strided = Eigen::Map<Matrix, 0, Eigen::OuterStride<>>;
using ConstStrided = Eigen::Map<const Matrix, 0, Eigen::OuterStride<>>;
using Dense = Eigen::Map<Matrix>;
using FloatRow = Eigen::Map<Eigen::ArrayXf>;

// Floats of the packed weights of one (batch, head) for T positions.
int64_t PackedLength(int64_t length, int64_t block) {
  int64_t total = 0;
  for (int64_t r0 = 0; r0 < length; r0 += block) {
    const int64_t r1 = std::min(length, r0 + block);
    total += (r1 - r0) * r1;
  }
  return total;
}

Status AttentionShape(InferenceContext* c) {
  ShapeHandle qkv;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &qkv));
  int64_t heads, block;
  TF_RETURN_IF_ERROR(c->GetAttr("num_heads", &heads));
  TF_RETURN_IF_ERROR(c->GetAttr("block_size", &block));
  DimensionHandle width;
  TF_RETURN_IF_ERROR(c->Divide(c->Dim(qkv, 2), 3, /*evenly_divisible=*/true, &width));
  c->set_output(0, c->MakeShape({c->Dim(qkv, 0), c->Dim(qkv, 1), width}));
  DimensionHandle packed = c->UnknownDim();
  if (c->ValueKnown(c->Dim(qkv, 1))) {
    packed = c->MakeDim(PackedLength(c->Value(c->Dim(qkv, 1)), block));
  }
  c->set_output(1, c->MakeShape({c->Dim(qkv, 0), c->MakeDim(heads), packed}));
  if (c->num_inputs() > 1) {  // segment_ids (B, T)
    ShapeHandle segments;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &segments));
    TF_RETURN_IF_ERROR(c->Merge(segments, c->MakeShape({c->Dim(qkv, 0), c->Dim(qkv, 1)}),
                                &segments));
  }
  return Status();
}

REGISTER_OP("TfgptCausalAttention")
    .Input("qkv: float")
    .Input(kSegmentIdsInput)
    .Output("output: float")
    .Output("weights: float")
    .Attr("num_heads: int >= 1")
    .Attr("block_size: int >= 1 = 64")
    .Attr(kSegmentedAttr)
    .SetShapeFn(AttentionShape)
    .Doc(R"doc(
Causal self-attention of `qkv` (B, T, 3C), laid out as (B, T, 3, H, D)
(queries, keys, values; H = num_heads heads of D = C / H): `output` (B, T, C)
holds the heads side by side, softmax(Q K^T / sqrt(D), causal) V.
`weights` (B, H, L) are the attention weights in a packed block-lower
layout, kept for the gradient. With `segment_ids` (one int32 (B, T) tensor,
or none), query q sees key k <= q only where segment_ids[b, k] ==
segment_ids[b, q] (packed examples).
)doc");

REGISTER_OP("TfgptCausalAttentionGrad")
    .Input("doutput: float")
    .Input("qkv: float")
    .Input("weights: float")
    .Input(kSegmentIdsInput)
    .Output("dqkv: float")
    .Attr("num_heads: int >= 1")
    .Attr("block_size: int >= 1 = 64")
    .Attr(kSegmentedAttr)
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(1));
      return Status();
    })
    .Doc("Gradient of TfgptCausalAttention for `qkv`.");

// Sizes of a (B, T, 3C) projection, or an error.
struct Sizes {
  int64_t batch, length, width, heads, head_dim;
};

Status CheckQkv(const TensorShape& shape, int64_t heads, Sizes* sizes) {
  if (shape.dims() != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "qkv must have rank 3, (B, T, 3C). Received shape ", shape.DebugString()));
  }
  if (shape.dim_size(2) % (3 * heads) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "qkv (B, T, 3C) needs C divisible by num_heads=", heads, ". Received shape ",
        shape.DebugString()));
  }
  sizes->batch = shape.dim_size(0);
  sizes->length = shape.dim_size(1);
  sizes->width = shape.dim_size(2) / 3;
  sizes->heads = heads;
  sizes->head_dim = sizes->width / heads;
  return Status();
}

// The (T, D) view of head `unit % H` of batch `unit / H`: in a (B, T, 3C)
// projection (parts = 3) its queries, keys or values (part 0, 1, 2), in a
// (B, T, C) tensor (parts = 1) its slice of the heads side by side.
template <typename Map, typename Pointer>
Map HeadView(Pointer data, int64_t unit, const Sizes& s, int64_t parts, int64_t part) {
  const int64_t b = unit / s.heads, h = unit % s.heads;
  return Map(data + (b * s.length * parts + part) * s.width + h * s.head_dim, s.length,
             s.head_dim, Eigen::OuterStride<>(parts * s.width));
}

// Runs fn(unit) for every (batch, head) unit on the op's thread pool.
template <typename Fn>
void ForEachHead(OpKernelContext* context, const Sizes& s, Fn fn) {
  const int64_t cost = 4 * s.length * s.length * s.head_dim + 1;
  context->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(
      s.batch * s.heads, cost, [&](int64_t begin, int64_t end) {
        for (int64_t unit = begin; unit < end; ++unit) fn(unit);
      });
}

// What both kernels share: the attributes, and the sizes of a projection
// with the packed weights' length per (batch, head).
class CausalAttentionKernel : public OpKernel {
 protected:
  explicit CausalAttentionKernel(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("num_heads", &heads_));
    OP_REQUIRES_OK(context, context->GetAttr("block_size", &block_));
    OP_REQUIRES_OK(context, GetSegmented(context, &segmented_));
  }

  Status Measure(const Tensor& qkv, Sizes* s, int64_t* packed) const {
    TF_RETURN_IF_ERROR(CheckQkv(qkv.shape(), heads_, s));
    *packed = PackedLength(s->length, block_);
    return Status();
  }

  int64_t heads_, block_;
  bool segmented_;
};

class CausalAttentionOp : public CausalAttentionKernel {
 public:
  explicit CausalAttentionOp(OpKernelConstruction* context) : CausalAttentionKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& qkv = context->input(0);
    Sizes s;
    int64_t packed;
    OP_REQUIRES_OK(context, Measure(qkv, &s, &packed));
    SegmentMask segments;
    OP_REQUIRES_OK(context, ReadSegments(context, segmented_, 1, s.batch, s.length, &segments));
    Tensor* output = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(
                                0, TensorShape({s.batch, s.length, s.width}), &output));
    Tensor* weights = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(
                                1, TensorShape({s.batch, s.heads, packed}), &weights));
    if (s.batch == 0 || s.length == 0 || s.width == 0) return;
    const float* in = qkv.flat<float>().data();
    float* out = output->flat<float>().data();
    float* w = weights->flat<float>().data();
    const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    const int64_t T = s.length, block = block_;
    ForEachHead(context, s, [&](int64_t unit) {
      const int64_t b = unit / s.heads;
      const auto q = HeadView<ConstStrided>(in, unit, s, 3, 0);
      const auto k = HeadView<ConstStrided>(in, unit, s, 3, 1);
      const auto v = HeadView<ConstStrided>(in, unit, s, 3, 2);
      auto o = HeadView<Strided>(out, unit, s, 1, 0);
      float* p = w + unit * packed;
      for (int64_t r0 = 0; r0 < T; r0 += block) {
        const int64_t r1 = std::min(T, r0 + block), rows = r1 - r0;
        const int64_t c0 = segments.First(b, r0, r1), keys = r1 - c0;
        Strided scores(p + c0, rows, keys, Eigen::OuterStride<>(r1));  // keys [c0, r1)
        scores.noalias() = q.middleRows(r0, rows) * k.middleRows(c0, keys).transpose();
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t query = r0 + r, first = segments.First(b, query);
          float* line = p + r * r1;
          FloatRow row(line + first, query + 1 - first);
          const bool run = segments.Run(b, query);
          if (!run) {
            for (int64_t key = first; key < query; ++key) {
              if (!segments.Sees(b, query, key)) {
                line[key] = -std::numeric_limits<float>::infinity();
              }
            }
          }
          const float max = row.maxCoeff();
          row = ((row - max) * scale).exp();
          if (!run) {
            for (int64_t key = first; key < query; ++key) {
              if (!segments.Sees(b, query, key)) line[key] = 0.0f;
            }
          }
          row *= 1.0f / row.sum();
          std::fill(line, line + first, 0.0f);
          std::fill(line + query + 1, line + r1, 0.0f);
        }
        o.middleRows(r0, rows).noalias() = scores * v.middleRows(c0, keys);
        p += rows * r1;
      }
    });
  }
};

class CausalAttentionGradOp : public CausalAttentionKernel {
 public:
  explicit CausalAttentionGradOp(OpKernelConstruction* context)
      : CausalAttentionKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& doutput = context->input(0);
    const Tensor& qkv = context->input(1);
    const Tensor& weights = context->input(2);
    Sizes s;
    int64_t packed;
    OP_REQUIRES_OK(context, Measure(qkv, &s, &packed));
    SegmentMask segments;
    OP_REQUIRES_OK(context, ReadSegments(context, segmented_, 3, s.batch, s.length, &segments));
    OP_REQUIRES(context, doutput.shape() == TensorShape({s.batch, s.length, s.width}),
                absl::InvalidArgumentError(absl::StrCat(
                    "doutput must be (B, T, C) = (", s.batch, ", ", s.length, ", ", s.width,
                    "). Received shape ", doutput.shape().DebugString())));
    OP_REQUIRES(context, weights.shape() == TensorShape({s.batch, s.heads, packed}),
                absl::InvalidArgumentError(absl::StrCat(
                    "weights must be TfgptCausalAttention's (B, H, L) = (", s.batch, ", ",
                    s.heads, ", ", packed, ") for the same block_size. Received shape ",
                    weights.shape().DebugString())));
    Tensor* dqkv = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, qkv.shape(), &dqkv));
    if (s.batch == 0 || s.length == 0 || s.width == 0) return;
    const float* dy = doutput.flat<float>().data();
    const float* in = qkv.flat<float>().data();
    const float* w = weights.flat<float>().data();
    float* dx = dqkv->flat<float>().data();
    const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    const int64_t T = s.length, block = block_;
    ForEachHead(context, s, [&](int64_t unit) {
      const int64_t b = unit / s.heads;
      const auto q = HeadView<ConstStrided>(in, unit, s, 3, 0);
      const auto k = HeadView<ConstStrided>(in, unit, s, 3, 1);
      const auto v = HeadView<ConstStrided>(in, unit, s, 3, 2);
      auto dq = HeadView<Strided>(dx, unit, s, 3, 0);
      auto dk = HeadView<Strided>(dx, unit, s, 3, 1);
      auto dv = HeadView<Strided>(dx, unit, s, 3, 2);
      const auto dout = HeadView<ConstStrided>(dy, unit, s, 1, 0);
      dk.setZero();
      dv.setZero();
      std::vector<float> scratch(std::min(block, T) * T);
      const float* p = w + unit * packed;
      for (int64_t r0 = 0; r0 < T; r0 += block) {
        const int64_t r1 = std::min(T, r0 + block), rows = r1 - r0;
        // The forward pass's keys [c0, r1): the weights before c0 are 0.
        const int64_t c0 = segments.First(b, r0, r1), keys = r1 - c0;
        ConstStrided probs(p + c0, rows, keys, Eigen::OuterStride<>(r1));
        Dense ds(scratch.data(), rows, keys);
        dv.middleRows(c0, keys).noalias() += probs.transpose() * dout.middleRows(r0, rows);
        ds.noalias() = dout.middleRows(r0, rows) * v.middleRows(c0, keys).transpose();
        for (int64_t r = 0; r < rows; ++r) {
          // Masked entries have weight 0, so their dS is 0 as well.
          auto pr = probs.row(r).array();
          auto dr = ds.row(r).array();
          const float dot = (pr * dr).sum();
          dr = pr * (dr - dot) * scale;
        }
        dq.middleRows(r0, rows).noalias() = ds * k.middleRows(c0, keys);
        dk.middleRows(c0, keys).noalias() += ds.transpose() * q.middleRows(r0, rows);
        p += rows * r1;
      }
    });
  }
};

REGISTER_KERNEL_BUILDER(Name("TfgptCausalAttention").Device(DEVICE_CPU), CausalAttentionOp);
REGISTER_KERNEL_BUILDER(Name("TfgptCausalAttentionGrad").Device(DEVICE_CPU),
                        CausalAttentionGradOp);

}  // namespace
}  // namespace tfgpt
