// AdamW's whole per-variable update, gradient clipping and decoupled weight
// decay included, as one multi-threaded pass over the variable.
//
// Keras's AdamW with `global_clipnorm` makes, per variable, a pass to scale
// the gradient (g * clip_scale), one for the weight decay
// (w -= w * weight_decay * lr) and the Adam step itself; TensorFlow's
// ResourceApplyAdam fuses only the last. Here all three are one loop over
// the elements, each read once from memory:
//
//   w -= w * decay                      (decay = weight_decay * lr, or 0)
//   g  = gradient * gradient_scale      (the global-norm clip factor, or 1)
//   m += (g - m) * (1 - beta_1)
//   v += (g^2 - v) * (1 - beta_2)
//   w -= m * alpha / (sqrt(v) + epsilon),
//   alpha = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)
//
// in float32, the order of operations of Keras's AdamW (and of
// ResourceApplyAdam, whose `1 - beta` is also formed in float32).
//
// Compiled without contracting a multiply and an add into one FMA, so that
// with no decay and a gradient scale of 1 the result is ResourceApplyAdam's
// bit for bit, and the decay alone ResourceApplyGradientDescent's.
//
// Variables are resource handles, updated in place under their mutexes
// (taken in address order), and copied first if another tensor still shares
// their buffer, as TensorFlow's own training ops do.

#include "common.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/platform/threadpool.h"

#pragma GCC optimize("fp-contract=off")

namespace tfgpt {

using ::tensorflow::Var;

REGISTER_OP("TfgptResourceApplyAdamW")
    .Input("var: resource")
    .Input("m: resource")
    .Input("v: resource")
    .Input("grad: float")
    .Input("lr: float")
    .Input("beta1: float")
    .Input("beta2: float")
    .Input("epsilon: float")
    .Input("beta1_power: float")
    .Input("beta2_power: float")
    .Input("decay: float")
    .Input("grad_scale: float")
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs)
    .Doc("AdamW step with gradient scaling and weight decay in one pass (float32).");

namespace {

// The variable's tensor, ready to be written in place: a private copy if
// its buffer is shared (a read still holds it) or in copy-on-read mode.
absl::Status Writable(OpKernelContext* context, Var* var, Tensor** out) {
  Tensor* tensor = var->tensor();
  if (var->copy_on_read_mode.load() || !tensor->RefCountIsOne()) {
    Tensor copy;
    TF_RETURN_IF_ERROR(context->allocate_temp(tensor->dtype(), tensor->shape(), &copy));
    const auto source = const_cast<const Tensor*>(tensor)->flat<float>();
    std::copy(source.data(), source.data() + source.size(), copy.flat<float>().data());
    *tensor = copy;
  }
  *out = tensor;
  return absl::OkStatus();
}

float Scalar(OpKernelContext* context, int index) {
  return context->input(index).scalar<float>()();
}

}  // namespace

class ResourceApplyAdamWOp : public OpKernel {
 public:
  explicit ResourceApplyAdamWOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    std::array<::tensorflow::core::RefCountPtr<Var>, 3> vars;
    for (int i = 0; i < 3; ++i) {
      OP_REQUIRES_OK(context, ::tensorflow::LookupResource(
                                  context, ::tensorflow::HandleFromInput(context, i), &vars[i]));
    }
    for (int i = 4; i < 12; ++i) {
      OP_REQUIRES(context, ::tensorflow::TensorShapeUtils::IsScalar(context->input(i).shape()),
                  InvalidArgument("input ", i, " must be a scalar, got shape ",
                                  context->input(i).shape().DebugString()));
    }
    // Locks in address order (the same variable may appear twice only by
    // mistake; it is rejected below before anything is written).
    std::array<Var*, 3> order = {vars[0].get(), vars[1].get(), vars[2].get()};
    OP_REQUIRES(context, order[0] != order[1] && order[0] != order[2] && order[1] != order[2],
                InvalidArgument("var, m and v must be three different variables"));
    std::sort(order.begin(), order.end());
    ::tensorflow::mutex_lock lock0(*order[0]->mu());
    ::tensorflow::mutex_lock lock1(*order[1]->mu());
    ::tensorflow::mutex_lock lock2(*order[2]->mu());

    const Tensor& grad = context->input(3);
    for (int i = 0; i < 3; ++i) {
      const Tensor* tensor = vars[i]->tensor();
      OP_REQUIRES(context, tensor->IsInitialized(),
                  InvalidArgument("variable input ", i, " is not initialized"));
      OP_REQUIRES(context, tensor->dtype() == ::tensorflow::DT_FLOAT,
                  InvalidArgument("variables must be float32, input ", i, " is ",
                                  ::tensorflow::DataTypeString(tensor->dtype())));
      OP_REQUIRES(context, tensor->shape() == grad.shape(),
                  InvalidArgument("variable input ", i, " has shape ",
                                  tensor->shape().DebugString(), " but grad has shape ",
                                  grad.shape().DebugString()));
    }
    std::array<Tensor*, 3> tensors;
    for (int i = 0; i < 3; ++i) {
      OP_REQUIRES_OK(context, Writable(context, vars[i].get(), &tensors[i]));
    }
    float* w = tensors[0]->flat<float>().data();
    float* m = tensors[1]->flat<float>().data();
    float* v = tensors[2]->flat<float>().data();
    const float* g = grad.flat<float>().data();

    const float lr = Scalar(context, 4), beta1 = Scalar(context, 5), beta2 = Scalar(context, 6);
    const float epsilon = Scalar(context, 7);
    const float beta1_power = Scalar(context, 8), beta2_power = Scalar(context, 9);
    const float decay = Scalar(context, 10), scale = Scalar(context, 11);
    const float alpha = lr * std::sqrt(1.0f - beta2_power) / (1.0f - beta1_power);
    const float one_minus_beta1 = 1.0f - beta1, one_minus_beta2 = 1.0f - beta2;

    auto update = [=](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        float weight = w[i] - w[i] * decay;
        const float gradient = g[i] * scale;
        const float first = m[i] + (gradient - m[i]) * one_minus_beta1;
        const float second = v[i] + (gradient * gradient - v[i]) * one_minus_beta2;
        m[i] = first;
        v[i] = second;
        w[i] = weight - (first * alpha) / (std::sqrt(second) + epsilon);
      }
    };
    const int64_t size = grad.NumElements();
    // Elements are independent; the cost per element is ~7 memory words.
    context->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(size, 20, update);
  }
};

REGISTER_KERNEL_BUILDER(Name("TfgptResourceApplyAdamW").Device(DEVICE_CPU),
                        ResourceApplyAdamWOp);

}  // namespace tfgpt
