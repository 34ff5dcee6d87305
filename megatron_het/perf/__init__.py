"""Performance model: FLOPs, parameters, memory, compute and communication time, profiles.

Pure functions over ``megatron_het.cluster`` types, in SI units (seconds, bytes, FLOPs).
Formulas and sources: docs/performance-model.md.
"""

from megatron_het.perf.comm import (
    HOST_STAGING_BANDWIDTH_GBPS,
    INTRA_NODE_LATENCY_US,
    Channel,
    CommTimes,
    GradientReduction,
    activation_message_bytes,
    bytes_per_s,
    chain_time,
    dp_gradient_reduction,
    p2p_channel,
    p2p_time,
    ring_all_gather_time,
    ring_all_reduce_time,
    ring_reduce_scatter_time,
    tp_channel,
    tp_layer_comm_times,
)
from megatron_het.perf.compute import (
    DEFAULT_EFFICIENCY,
    EfficiencyCurve,
    LayerTimes,
    efficiency_curve_for,
    embedding_times,
    gemm_time,
    layer_elementwise_bytes,
    layer_times,
    logits_times,
)
from megatron_het.perf.flops import (
    BACKWARD_TO_FORWARD,
    RECOMPUTE_MODES,
    Gemm,
    Recompute,
    embedding_parameters,
    final_norm_parameters,
    layer_forward_flops,
    layer_gemms,
    layer_parameters,
    layer_parameters_per_rank,
    layer_training_flops,
    logits_forward_flops,
    logits_gemm,
    model_flops_per_iteration,
    output_parameters,
    padded_vocab_size,
    stage_parameters,
    total_parameters,
)
from megatron_het.perf.memory import (
    DEFAULT_OVERHEAD_BYTES,
    GRAD_BYTES,
    OPTIMIZER_BYTES,
    PARAM_BYTES,
    StageMemory,
    activation_bytes_per_layer,
    device_capacity_bytes,
    first_stage_extra_activation_bytes,
    last_stage_extra_activation_bytes,
    microbatches_in_flight,
    stage_memory,
)
from megatron_het.perf.profile import (
    PROFILE_FORMAT,
    PROFILE_VERSION,
    Profile,
    ProfileEntry,
    load_profile,
    lookup,
    profile_from_dict,
    profile_to_dict,
    save_profile,
)

__all__ = [
    # flops
    "BACKWARD_TO_FORWARD", "RECOMPUTE_MODES", "Gemm", "Recompute", "embedding_parameters",
    "final_norm_parameters", "layer_forward_flops", "layer_gemms", "layer_parameters",
    "layer_parameters_per_rank", "layer_training_flops", "logits_forward_flops", "logits_gemm",
    "model_flops_per_iteration", "output_parameters", "padded_vocab_size", "stage_parameters",
    "total_parameters",
    # memory
    "DEFAULT_OVERHEAD_BYTES", "GRAD_BYTES", "OPTIMIZER_BYTES", "PARAM_BYTES", "StageMemory",
    "activation_bytes_per_layer", "device_capacity_bytes", "first_stage_extra_activation_bytes",
    "last_stage_extra_activation_bytes", "microbatches_in_flight", "stage_memory",
    # compute
    "DEFAULT_EFFICIENCY", "EfficiencyCurve", "LayerTimes", "efficiency_curve_for", "embedding_times",
    "gemm_time", "layer_elementwise_bytes", "layer_times", "logits_times",
    # comm
    "HOST_STAGING_BANDWIDTH_GBPS", "INTRA_NODE_LATENCY_US", "Channel", "CommTimes", "GradientReduction",
    "activation_message_bytes", "bytes_per_s", "chain_time", "dp_gradient_reduction", "p2p_channel",
    "p2p_time", "ring_all_gather_time", "ring_all_reduce_time", "ring_reduce_scatter_time", "tp_channel",
    "tp_layer_comm_times",
    # profile
    "PROFILE_FORMAT", "PROFILE_VERSION", "Profile", "ProfileEntry", "load_profile", "lookup",
    "profile_from_dict", "profile_to_dict", "save_profile",
]

from megatron_het.perf.predict import (  # noqa: E402
    OPTIMIZER_STEP_BYTES,
    Prediction,
    ReplicaPrediction,
    StageCost,
    StagePrediction,
    predict,
    profile_for,
    stage_cost,
)

__all__ += [
    "OPTIMIZER_STEP_BYTES", "Prediction", "ReplicaPrediction", "StageCost", "StagePrediction", "predict",
    "profile_for", "stage_cost",
]
