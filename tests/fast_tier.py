"""The fast tier: ``python -m pytest -m fast`` (goal ≤ 60 s on 2 cores with torch installed) touches every layer once.

Run it first and before every commit; the full suite (``bash .ci/run``) is for before a merge. The entries are pytest
node ids or prefixes of them (a file, or a test without its parameters); tests/conftest.py marks what they select
with ``fast``, and tests/test_fast_tier.py fails when an entry no longer names a test. A test that is not
installed (a framework missing) is skipped there as everywhere else.
"""

FAST_TIER = (
    # transport: the typed options, and the transport suite's collectives over TCP (np = 2, one job) and shared
    # memory (np = 3, one job)
    "tests/transport/test_tcp.py::test_transport_options_are_typed_and_refuse_unknown_names",
    "tests/transport/test_transport_conformance.py::test_allreduce[tcp-np2]",
    "tests/transport/test_transport_conformance.py::test_allreduce_finish[tcp-np2]",
    "tests/transport/test_transport_conformance.py::test_allgatherv[tcp-np2]",
    "tests/transport/test_transport_conformance.py::test_broadcast[tcp-np2]",
    "tests/transport/test_transport_conformance.py::test_alltoallv[tcp-np2]",
    "tests/transport/test_transport_conformance.py::test_reducescatter[tcp-np2]",
    "tests/transport/test_transport_conformance.py::test_allreduce[shm-np3]",
    "tests/transport/test_transport_conformance.py::test_subgroups[shm-np3]",
    # engine: its unit tests (negotiation, fusion, cache, config) and one init/shutdown cycle over real ranks
    "tests/engine/test_engine_units.py",
    "tests/engine/test_liveness.py::test_queued_bytes_count_as_life_and_the_same_queue_does_not",
    "tests/engine/test_liveness.py::test_control_reads_by_any_path_count_as_life",
    "tests/engine/test_engine_lifecycle.py::test_shutdown_then_init_with_other_process_sets",
    # agreement: every strategy of the chain over real ranks (alone, the lane on shm and tcp, the coordinator),
    # the hold, and the warm rounds on shared memory and over TCP
    "tests/engine/test_agreement.py",
    "tests/engine/test_fast_lane.py::test_fast_lane_results_match_numpy_and_engage[shm-2]",
    "tests/engine/test_fast_lane.py::test_fast_lane_results_match_numpy_and_engage[tcp-2]",
    "tests/engine/test_lane_hold.py::test_an_asynchronous_call_waited_for_at_once_takes_the_lane[shm-2]",
    "tests/engine/test_lane_hold.py::test_a_held_call_is_numbered_before_the_next_call[tcp-3]",
    "tests/engine/test_warm_path.py::test_repeated_collectives_in_any_order_run_warm_and_stay_right[2]",
    "tests/engine/test_warm_path.py::test_repeated_collectives_run_warm_over_tcp_rounds[2-None]",
    # common: the adapters every binding shares, the elastic bookkeeping
    "tests/test_binding_adapters.py",
    "tests/elastic/test_elastic_units.py",
    # bindings: each installed binding through the one conformance suite, plus one training-shaped test each
    "tests/conformance/test_collective_conformance.py::test_allreduce_f32[numpy-tcp-np2]",
    "tests/conformance/test_collective_conformance.py::test_allreduce_f32[torch-tcp-np2]",
    "tests/conformance/test_collective_conformance.py::test_allreduce_f32[tensorflow-tcp-np2]",
    "tests/conformance/test_collective_conformance.py::test_allreduce_f32[jax-tcp-np2]",
    "tests/conformance/test_collective_conformance.py::test_allreduce_f32[mxnet-tcp-np2]",
    # the device executor's NCCL path, on the CPU through the stand-in NCCL (tests/gpu/standin_nccl)
    "tests/conformance/test_collective_conformance.py::test_allreduce_f32[device-nccl-tcp-np2]",
    "tests/torch/test_torch_optimizer.py::test_distributed_optimizer_matches_single_process[2]",
    "tests/tensorflow/test_tensorflow_ops.py::test_one_rank",
    "tests/keras/test_keras.py::test_one_rank_fit_and_reload[keras3]",
    "tests/jax/test_jax_api.py::test_argument_errors_in_one_process",
    # runner: horovod.run over real processes, and its argument checks
    "tests/runner/test_runner_api.py::test_returns_every_ranks_value_in_rank_order",
    "tests/runner/test_runner_api.py::test_value_errors",
    # knobs: typed fields (a misspelt one fails mypy) and every value checked where it is declared
    "tests/engine/test_config.py::test_a_misspelt_knob_is_a_mypy_error",
    "tests/engine/test_config.py::test_the_values_the_issue_reported",
    # elastic: a reset leaves the torch DistributedOptimizer as fresh as after construction
    "tests/elastic/test_elastic_torch_backward.py::test_load_state_dict_forgets_the_step_in_progress",
    # docs and layering: imports point down, documented commands and names are real
    "tests/test_layering.py",
    "tests/test_module_size.py",
    "tests/test_docs.py",
    "tests/test_install_docs.py",
    "tests/test_framework_rules.py",
    "tests/test_fast_tier.py",
    "tests/test_public_names.py",
)


def selects(entry: str, nodeid: str) -> bool:
    """Whether ``entry`` names ``nodeid``: the same id, its file, or the test without its parameters."""
    return nodeid == entry or nodeid.startswith(entry + "::") or nodeid.startswith(entry + "[")
