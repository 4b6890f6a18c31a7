"""The end-to-end tests' study: a 4-block MLP on 2 gloo ranks, few trials."""

STUDY = """
[study]
name = "e2e"
[workload]
factory = "runtime.reference_workloads:mlp"
kwargs = {{ dim = 128, layers = 4 }}
[search]
space = "{space}"
sim_trials = 30
measured_trials = 2
[measure]
warmup_steps = 1
steps = 3
max_rounds = 6
confirm_max_rounds = 8
confirm_launches = 2
profile_repeats = 2
"""
