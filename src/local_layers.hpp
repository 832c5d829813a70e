// The classes tessera_layers (src/layers_cpu.cpp) and tessera_cuda_kernels (src/layers_cuda.cpp)
// compile once for the one-process Envs: every class whose header ends in TESSERA_LOCAL_EXTERN
// (comm/local_env.hpp explains). LIST(INSTANCES) expands INSTANCES(, Class, extra arguments) for
// each, INSTANCES being TESSERA_LOCAL_CPU_INSTANCES or TESSERA_LOCAL_CUDA_INSTANCES.
#pragma once

#include "tessera/comm/local.hpp"
#include "tessera/layers/activation.hpp"
#include "tessera/layers/attention.hpp"
#include "tessera/layers/batch_norm.hpp"
#include "tessera/layers/conv2d.hpp"
#include "tessera/layers/dropout.hpp"
#include "tessera/layers/embedding.hpp"
#include "tessera/layers/flatten.hpp"
#include "tessera/layers/linear.hpp"
#include "tessera/layers/norm.hpp"
#include "tessera/layers/pool.hpp"
#include "tessera/losses/cross_entropy.hpp"
#include "tessera/losses/mse.hpp"
#include "tessera/losses/nll.hpp"
#include "tessera/models/gpt.hpp"
#include "tessera/models/mlp.hpp"
#include "tessera/models/resnet.hpp"

#define TESSERA_LOCAL_LAYER_LIST(INSTANCES) \
  INSTANCES(, Pointwise, ReluOp)            \
  INSTANCES(, Pointwise, GeluOp)            \
  INSTANCES(, BatchNorm2d)                  \
  INSTANCES(, Conv2d)                       \
  INSTANCES(, Dropout)                      \
  INSTANCES(, Flatten)                      \
  INSTANCES(, Linear)                       \
  INSTANCES(, MaxPool2d)                    \
  INSTANCES(, AvgPool2d)                    \
  INSTANCES(, AdaptiveAvgPool2d)            \
  INSTANCES(, GlobalAvgPool)                \
  INSTANCES(, CrossEntropyLoss)             \
  INSTANCES(, MseLoss)                      \
  INSTANCES(, NLLLoss)                      \
  INSTANCES(, Mlp)                          \
  INSTANCES(, ResNet, BasicBlock)           \
  INSTANCES(, ResNet, Bottleneck)           \
  INSTANCES(, Embedding)                    \
  INSTANCES(, detail::NormLayer, true)      \
  INSTANCES(, detail::NormLayer, false)     \
  INSTANCES(, ScaledDotProductAttention)    \
  INSTANCES(, SelfAttention)                \
  INSTANCES(, GPTBlock)                     \
  INSTANCES(, GPT)

