"""Which graph ops draw from the RNG, without importing torch: a table of torch's random operators (the ops that
carry `torch.Tag.nondeterministic_seeded`) for the namespaces torch defines itself, so that planning and simulating
a graph file need no torch. tests/test_ops.py checks the table against torch's tags, so it cannot drift."""

from __future__ import annotations

from functools import cache

from xsched.contracts.graph import Graph

# namespaces whose random ops the table lists completely; an op of another namespace (a library's custom op) is
# asked of torch itself
TABLE_NAMESPACES = ("aten", "prims", "rngprims")

# op -> its overloads tagged nondeterministic_seeded (torch 2.13)
RANDOM_OVERLOADS: dict[str, tuple[str, ...]] = {
    "aten._cudnn_attention_backward": ("default",),
    "aten._cudnn_attention_forward": ("default",),
    "aten._cudnn_init_dropout_state": ("default", "out"),
    "aten._cudnn_rnn": ("default", "out"),
    "aten._efficient_attention_forward": ("default",),
    "aten._fill_mem_eff_dropout_mask_": ("default",),
    "aten._flash_attention_forward": ("default", "quantized"),
    "aten._flash_attention_forward_no_dropout_inplace": ("default",),
    "aten._fused_dropout": ("default", "out"),
    "aten._fused_sdp_choice": ("default",),
    "aten._lstm_mps": ("default", "out"),
    "aten._nested_tensor_softmax_with_shape": ("default",),
    "aten._sample_dirichlet": ("default", "out"),
    "aten._scaled_dot_product_attention_math": ("default",),
    "aten._scaled_dot_product_attention_math_for_mps": ("default",),
    "aten._scaled_dot_product_cudnn_attention": ("default",),
    "aten._scaled_dot_product_cudnn_attention_backward": ("default",),
    "aten._scaled_dot_product_efficient_attention": ("default",),
    "aten._scaled_dot_product_efficient_attention_backward": ("default",),
    "aten._scaled_dot_product_flash_attention": ("default", "quantized"),
    "aten._scaled_dot_product_flash_attention_for_cpu": ("default",),
    "aten._scaled_dot_product_fused_attention_overrideable": ("default",),
    "aten._standard_gamma": ("default", "out"),
    "aten._triton_scaled_dot_attention": ("default", "out"),
    "aten.alpha_dropout": ("default",),
    "aten.alpha_dropout_": ("default",),
    "aten.bernoulli": ("Tensor", "Tensor_out", "default", "float_out", "out", "p"),
    "aten.bernoulli_": ("Tensor", "float"),
    "aten.binomial": ("default", "out"),
    "aten.cauchy": ("default", "out"),
    "aten.cauchy_": ("default",),
    "aten.dropout": ("default",),
    "aten.dropout_": ("default",),
    "aten.exponential": ("default", "out"),
    "aten.exponential_": ("default",),
    "aten.feature_alpha_dropout": ("default",),
    "aten.feature_alpha_dropout_": ("default",),
    "aten.feature_dropout": ("default",),
    "aten.feature_dropout_": ("default",),
    "aten.geometric": ("default", "out"),
    "aten.geometric_": ("default",),
    "aten.gru": ("data", "input"),
    "aten.log_normal": ("default", "out"),
    "aten.log_normal_": ("default",),
    "aten.lstm": ("data", "input"),
    "aten.miopen_rnn": ("default", "out"),
    "aten.multinomial": ("default", "out"),
    "aten.native_dropout": ("default", "out"),
    "aten.normal": (
        "Tensor_Tensor",
        "Tensor_Tensor_out",
        "Tensor_float",
        "Tensor_float_out",
        "float_Tensor",
        "float_Tensor_out",
        "float_float",
        "float_float_out",
        "out",
    ),
    "aten.normal_": ("default",),
    "aten.normal_functional": ("default",),
    "aten.poisson": ("default", "out"),
    "aten.rand": ("default", "generator", "generator_out", "out"),
    "aten.rand_like": ("default", "generator", "generator_out", "out"),
    "aten.randint": (
        "default",
        "generator",
        "generator_out",
        "low",
        "low_generator",
        "low_generator_out",
        "low_out",
        "out",
    ),
    "aten.randint_like": (
        "Tensor",
        "Tensor_generator",
        "Tensor_generator_out",
        "Tensor_out",
        "default",
        "generator",
        "generator_out",
        "low_dtype",
        "low_dtype_out",
        "low_generator_dtype",
        "low_generator_dtype_out",
        "out",
    ),
    "aten.randn": ("default", "generator", "generator_out", "out"),
    "aten.randn_like": ("default", "generator", "generator_out", "out"),
    "aten.random": ("default", "from", "from_out", "out", "to", "to_out"),
    "aten.random_": ("default", "from", "to"),
    "aten.randperm": ("default", "generator", "generator_out", "out"),
    "aten.rnn_relu": ("data", "input"),
    "aten.rnn_tanh": ("data", "input"),
    "aten.rrelu": ("default",),
    "aten.rrelu_": ("default",),
    "aten.rrelu_with_noise": ("default", "out"),
    "aten.rrelu_with_noise_": ("default",),
    "aten.rrelu_with_noise_functional": ("default",),
    "aten.scaled_dot_product_attention": ("default",),
    "aten.uniform": ("default", "out"),
    "aten.uniform_": ("default",),
    "prims.normal": ("default",),
    "prims.uniform": ("default",),
    "rngprims.philox_rand": ("default",),
}
RANDOM_TARGETS = frozenset(f"{op}.{overload}" for op, overloads in RANDOM_OVERLOADS.items() for overload in overloads)


@cache
def is_random_target(target: str) -> bool:
    """Ops that draw from the RNG (dropout, bernoulli, rand*): recomputing them must replay the same state. A target
    that is not `namespace.name.overload` (ONNX's `onnx::Dropout`, the importers' names) is not a torch op."""
    parts = target.split(".")
    if len(parts) != 3:
        return False
    if parts[0] in TABLE_NAMESPACES:
        return target in RANDOM_TARGETS
    from xsched.contracts.torch_ops import has_random_tag  # a custom op: only torch knows (imports torch)

    return has_random_tag(target)


def random_ops(graph: Graph) -> frozenset[str]:
    """Ids of the ops of `graph` that draw from the RNG."""
    return frozenset(o.id for o in graph.ops if is_random_target(o.target))
