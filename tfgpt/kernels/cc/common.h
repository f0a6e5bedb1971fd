// What every tfgpt kernel source starts from: TensorFlow's op and kernel
// framework and Eigen's thread-pool device, with the names they all use
// declared once in `tfgpt`.

#ifndef TFGPT_KERNELS_CC_COMMON_H_
#define TFGPT_KERNELS_CC_COMMON_H_

// Before any Eigen header: kernels evaluate on the op's thread pool.
#define EIGEN_USE_THREADS

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tfgpt {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::errors::InvalidArgument;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;
using CPUDevice = Eigen::ThreadPoolDevice;

}  // namespace tfgpt

#endif  // TFGPT_KERNELS_CC_COMMON_H_
