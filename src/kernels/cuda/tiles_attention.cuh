// Placeholder until the attention tiles land (KDA core, MLA latent/core/merge, K3's q LoRA).
#pragma once
#include "gemv.cuh"

MD_CUDA_BEGIN

MD_DEV void kda_core_tile(const DevStep&, const plan::Instr&, const Args&, Pipe&) {
  port::trap("kda_core: not implemented on CUDA yet");
}
MD_DEV void mla_latent_tile(const DevStep&, const plan::Instr&, const Args&) {
  port::trap("mla_latent: not implemented on CUDA yet");
}
MD_DEV void mla_core_tile(const DevStep&, const plan::Instr&, const Args&) {
  port::trap("mla_core: not implemented on CUDA yet");
}
MD_DEV void mla_merge_tile(const DevStep&, const plan::Instr&, const Args&) {
  port::trap("mla_merge: not implemented on CUDA yet");
}
MD_DEV void mla_q_up_tile(const DevStep&, const plan::Instr&, const Args&, Pipe&) {
  port::trap("mla_q_up: not implemented on CUDA yet");
}

MD_CUDA_END
