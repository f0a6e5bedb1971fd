// Layer normalization over the last axis and its gradient, each as one
// fused, multi-threaded CPU kernel.
//
// Keras's LayerNormalization runs as separate Mean, SquaredDifference,
// Rsqrt, Mul, Sub and Add ops forward and about fifteen ops backward, each
// a pass over the (B, T, C) activations, with bfloat16 <-> float32 casts
// around them under mixed precision. Here each direction is one pass over
// the rows, a row at a time while it sits in L1, in float32 whatever the
// storage type. For a row x of width D (Ba et al. 2016):
//
//   mean = sum(x) / D,  var = sum((x - mean)^2) / D,  rstd = 1 / sqrt(var + eps)
//   xhat = (x - mean) rstd,  y = xhat gamma + beta
//
// and, with g = dy gamma:
//
//   dx = rstd (g - mean(g) - xhat mean(g xhat))
//   dgamma = sum over rows of dy xhat,  dbeta = sum over rows of dy
//
// The forward op also returns each row's mean and rstd (float32) so the
// backward pass does not recompute them.
//
// dgamma and dbeta are sums over all rows. Each block of a fixed number of
// rows (set by the shape alone, not by the thread count) sums its rows in
// order into its own buffer; the blocks are then added in block order. The
// result is the same bit for bit whatever the threads' scheduling.

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/platform/threadpool.h"

namespace tfgpt {

namespace {

template <typename T>
using ConstRow = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;
template <typename T>
using Row = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;

// The row as float32: the row itself for float, else converted into `scratch`.
template <typename T>
const float* AsFloat(const T* row, int64_t width, float* scratch) {
  Row<float>(scratch, width) = ConstRow<T>(row, width).template cast<float>();
  return scratch;
}

template <>
const float* AsFloat<float>(const float* row, int64_t, float*) {
  return row;
}

// Rows per block of the gradient's partial sums: about 16K elements each,
// at most 256 blocks. Depends on the shape only (see the file comment).
int64_t RowsPerBlock(int64_t rows, int64_t width) {
  const int64_t kElementsPerBlock = 16384, kMaxBlocks = 256;
  int64_t per_block = std::max<int64_t>(1, kElementsPerBlock / std::max<int64_t>(width, 1));
  per_block = std::max(per_block, (rows + kMaxBlocks - 1) / kMaxBlocks);
  return per_block;
}

// Shape function: y like x; mean and rstd like x without its last axis;
// gamma and beta vectors as wide as x's last axis.
absl::Status LayerNormShape(InferenceContext* c) {
  ShapeHandle x, gamma, beta, rows;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &x));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &gamma));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &beta));
  DimensionHandle width = c->Dim(x, -1);
  TF_RETURN_IF_ERROR(c->Merge(width, c->Dim(gamma, 0), &width));
  TF_RETURN_IF_ERROR(c->Merge(width, c->Dim(beta, 0), &width));
  TF_RETURN_IF_ERROR(c->Subshape(x, 0, -1, &rows));
  c->set_output(0, x);
  c->set_output(1, rows);
  c->set_output(2, rows);
  return absl::OkStatus();
}

absl::Status LayerNormGradShape(InferenceContext* c) {
  ShapeHandle dy, x, gamma, rows;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(1), 1, &x));
  TF_RETURN_IF_ERROR(c->Merge(c->input(0), x, &dy));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &gamma));
  DimensionHandle width = c->Dim(dy, -1);
  TF_RETURN_IF_ERROR(c->Merge(width, c->Dim(gamma, 0), &width));
  TF_RETURN_IF_ERROR(c->Subshape(dy, 0, -1, &rows));
  TF_RETURN_IF_ERROR(c->Merge(rows, c->input(3), &rows));
  TF_RETURN_IF_ERROR(c->Merge(rows, c->input(4), &rows));
  ShapeHandle vector = c->Vector(width);
  c->set_output(0, dy);
  c->set_output(1, vector);
  c->set_output(2, vector);
  return absl::OkStatus();
}

// The width of x's last axis, after checking that x has one and that each
// of `vectors` is a vector of that width.
absl::Status CheckWidth(
    const Tensor& x, std::initializer_list<std::pair<const char*, const Tensor*>> vectors) {
  if (x.dims() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "x must have at least one axis (the one normalized over); received shape ",
        x.shape().DebugString()));
  }
  const int64_t width = x.dim_size(x.dims() - 1);
  for (const auto& [name, vector] : vectors) {
    if (vector->dims() != 1 || vector->dim_size(0) != width) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " must be a vector as wide as x's last axis (", width, "); received shape ",
          vector->shape().DebugString(), " for x of shape ", x.shape().DebugString()));
    }
  }
  return absl::OkStatus();
}

TensorShape RowsShape(const Tensor& x) {
  TensorShape rows = x.shape();
  rows.RemoveLastDims(1);
  return rows;
}

}  // namespace

REGISTER_OP("TfgptLayerNorm")
    .Input("x: T")
    .Input("gamma: float")
    .Input("beta: float")
    .Output("y: T")
    .Output("mean: float")
    .Output("rstd: float")
    .Attr("T: {float, bfloat16, half}")
    .Attr("epsilon: float = 0.001")
    .SetShapeFn(LayerNormShape)
    .Doc(R"doc(
Layer normalization over the last axis in one pass (float32 math).

y = (x - mean) * rstd * gamma + beta, rstd = 1 / sqrt(var + epsilon), with
the mean and (biased) variance of each row of x's last axis. `mean` and
`rstd` are those statistics, one per row, for TfgptLayerNormGrad.
)doc");

REGISTER_OP("TfgptLayerNormGrad")
    .Input("dy: T")
    .Input("x: T")
    .Input("gamma: float")
    .Input("mean: float")
    .Input("rstd: float")
    .Output("dx: T")
    .Output("dgamma: float")
    .Output("dbeta: float")
    .Attr("T: {float, bfloat16, half}")
    .SetShapeFn(LayerNormGradShape)
    .Doc("Gradients of TfgptLayerNorm with respect to x, gamma and beta, in one pass.");

template <typename T>
class LayerNormOp : public OpKernel {
 public:
  explicit LayerNormOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("epsilon", &epsilon_));
    OP_REQUIRES(context, epsilon_ >= 0.0f,
                absl::InvalidArgumentError(absl::StrCat(
                    "epsilon must be non-negative; received ", epsilon_)));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& x = context->input(0);
    const Tensor& gamma = context->input(1);
    const Tensor& beta = context->input(2);
    OP_REQUIRES_OK(context, CheckWidth(x, {{"gamma", &gamma}, {"beta", &beta}}));
    const int64_t width = x.dim_size(x.dims() - 1);
    const TensorShape rows_shape = RowsShape(x);
    const int64_t rows = rows_shape.num_elements();

    Tensor *y = nullptr, *mean = nullptr, *rstd = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, x.shape(), &y));
    OP_REQUIRES_OK(context, context->allocate_output(1, rows_shape, &mean));
    OP_REQUIRES_OK(context, context->allocate_output(2, rows_shape, &rstd));
    if (rows == 0) return;
    float* mean_data = mean->flat<float>().data();
    float* rstd_data = rstd->flat<float>().data();
    if (width == 0) {  // Empty rows: statistics 0/0, as reduce_mean gives.
      std::fill_n(mean_data, rows, std::numeric_limits<float>::quiet_NaN());
      std::fill_n(rstd_data, rows, std::numeric_limits<float>::quiet_NaN());
      return;
    }

    const T* x_data = x.flat<T>().data();
    T* y_data = y->flat<T>().data();
    const ConstRow<float> g(gamma.flat<float>().data(), width);
    const ConstRow<float> b(beta.flat<float>().data(), width);
    const float inverse_width = 1.0f / static_cast<float>(width);
    const float epsilon = epsilon_;

    auto normalize = [&](int64_t begin, int64_t end) {
      Eigen::ArrayXf scratch(std::is_same<T, float>::value ? 0 : width);
      for (int64_t r = begin; r < end; ++r) {
        const ConstRow<float> xr(AsFloat(x_data + r * width, width, scratch.data()), width);
        const float m = xr.sum() * inverse_width;
        const float variance = (xr - m).square().sum() * inverse_width;
        const float s = 1.0f / std::sqrt(variance + epsilon);
        mean_data[r] = m;
        rstd_data[r] = s;
        Row<T>(y_data + r * width, width) = ((xr - m) * s * g + b).template cast<T>();
      }
    };
    // Cost per row in cycles, roughly: two reductions and one write pass.
    context->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(
        rows, 6 * width + 40, normalize);
  }

 private:
  float epsilon_;
};

template <typename T>
class LayerNormGradOp : public OpKernel {
 public:
  explicit LayerNormGradOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& dy = context->input(0);
    const Tensor& x = context->input(1);
    const Tensor& gamma = context->input(2);
    const Tensor& mean = context->input(3);
    const Tensor& rstd = context->input(4);
    OP_REQUIRES(context, dy.shape() == x.shape(),
                absl::InvalidArgumentError(absl::StrCat(
                    "dy and x must have the same shape; received ", dy.shape().DebugString(),
                    " and ", x.shape().DebugString())));
    OP_REQUIRES_OK(context, CheckWidth(x, {{"gamma", &gamma}}));
    const TensorShape rows_shape = RowsShape(x);
    OP_REQUIRES(context, mean.shape() == rows_shape && rstd.shape() == rows_shape,
                absl::InvalidArgumentError(absl::StrCat(
                    "mean and rstd must have x's shape without its last axis (",
                    rows_shape.DebugString(), "); received ", mean.shape().DebugString(),
                    " and ", rstd.shape().DebugString())));
    const int64_t width = x.dim_size(x.dims() - 1);
    const int64_t rows = rows_shape.num_elements();

    Tensor *dx = nullptr, *dgamma = nullptr, *dbeta = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, x.shape(), &dx));
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({width}), &dgamma));
    OP_REQUIRES_OK(context, context->allocate_output(2, TensorShape({width}), &dbeta));
    Row<float> dgamma_out(dgamma->flat<float>().data(), width);
    Row<float> dbeta_out(dbeta->flat<float>().data(), width);
    dgamma_out.setZero();
    dbeta_out.setZero();
    if (rows == 0 || width == 0) return;

    const int64_t per_block = RowsPerBlock(rows, width);
    const int64_t blocks = (rows + per_block - 1) / per_block;
    // Per block: its dgamma partial sum, then its dbeta partial sum.
    Tensor partial;
    OP_REQUIRES_OK(context, context->allocate_temp(
                                ::tensorflow::DT_FLOAT, TensorShape({blocks, 2, width}), &partial));
    float* partial_data = partial.flat<float>().data();

    const T* dy_data = dy.flat<T>().data();
    const T* x_data = x.flat<T>().data();
    T* dx_data = dx->flat<T>().data();
    const float* mean_data = mean.flat<float>().data();
    const float* rstd_data = rstd.flat<float>().data();
    const ConstRow<float> g(gamma.flat<float>().data(), width);
    const float inverse_width = 1.0f / static_cast<float>(width);

    auto backward = [&](int64_t first_block, int64_t end_block) {
      const bool convert = !std::is_same<T, float>::value;
      Eigen::ArrayXf x_scratch(convert ? width : 0), dy_scratch(convert ? width : 0);
      Eigen::ArrayXf xhat(width), dy_gamma(width);
      for (int64_t block = first_block; block < end_block; ++block) {
        Row<float> dgamma_sum(partial_data + (2 * block) * width, width);
        Row<float> dbeta_sum(partial_data + (2 * block + 1) * width, width);
        dgamma_sum.setZero();
        dbeta_sum.setZero();
        const int64_t end = std::min(rows, (block + 1) * per_block);
        for (int64_t r = block * per_block; r < end; ++r) {
          const ConstRow<float> xr(AsFloat(x_data + r * width, width, x_scratch.data()), width);
          const ConstRow<float> dyr(AsFloat(dy_data + r * width, width, dy_scratch.data()), width);
          const float s = rstd_data[r];
          xhat = (xr - mean_data[r]) * s;
          dy_gamma = dyr * g;
          const float mean_dy_gamma = dy_gamma.sum() * inverse_width;
          const float mean_dy_gamma_xhat = (dy_gamma * xhat).sum() * inverse_width;
          Row<T>(dx_data + r * width, width) =
              ((dy_gamma - mean_dy_gamma - xhat * mean_dy_gamma_xhat) * s).template cast<T>();
          dgamma_sum += dyr * xhat;
          dbeta_sum += dyr;
        }
      }
    };
    auto* workers = context->device()->tensorflow_cpu_worker_threads()->workers;
    workers->ParallelFor(blocks, per_block * (12 * width + 40), backward);

    // The blocks' partial sums, added in block order for each column.
    auto reduce = [&](int64_t begin, int64_t end) {
      const int64_t n = end - begin;
      for (int64_t block = 0; block < blocks; ++block) {
        dgamma_out.segment(begin, n) +=
            ConstRow<float>(partial_data + (2 * block) * width + begin, n);
        dbeta_out.segment(begin, n) +=
            ConstRow<float>(partial_data + (2 * block + 1) * width + begin, n);
      }
    };
    workers->ParallelFor(width, 2 * blocks + 10, reduce);
  }
};

#define REGISTER(T)                                                                      \
  REGISTER_KERNEL_BUILDER(                                                               \
      Name("TfgptLayerNorm").Device(DEVICE_CPU).TypeConstraint<T>("T"), LayerNormOp<T>); \
  REGISTER_KERNEL_BUILDER(                                                               \
      Name("TfgptLayerNormGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"),              \
      LayerNormGradOp<T>);

REGISTER(float)
REGISTER(Eigen::bfloat16)
REGISTER(Eigen::half)
#undef REGISTER

}  // namespace tfgpt
