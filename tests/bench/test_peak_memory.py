"""bench.peak_memory's diagnostic line: each plan's prediction against its lowest measured rank-step."""

from bench.peak_memory import lowest_step_errors

BLOCK = 51_388_416  # one checkpointed Llama block's unsharded bytes, the step the CPU peaks move by


def test_the_prediction_is_set_against_the_lowest_step_of_any_rank():
    floor = 1_000 * BLOCK // 40
    on_floor = (floor, [[floor + BLOCK, floor, floor + 2 * BLOCK], [floor + BLOCK, floor + BLOCK, floor + BLOCK]])
    over = (floor + BLOCK // 10, [[floor + BLOCK], [floor]])
    under = (floor - BLOCK // 10, [[floor, floor]])
    errors = lowest_step_errors([on_floor, over, under])
    assert errors[0] == 0.0  # the median step (one block up) is not what it reads
    assert round(errors[1], 6) == round(100 * (BLOCK // 10) / floor, 6)
    assert errors[2] < 0
