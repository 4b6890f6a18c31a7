"""The simulator's numeric kernel: one FSDP2 step over per-module arrays.

Written as plain loops over NumPy arrays so numba can compile it
(``@njit``); without numba it runs as ordinary Python, same results. The
rules and their FSDP2 sources are described in :mod:`planner.simulator`;
comments here cite the function each block follows.

State arrays:
    s (float64): [0] t_cpu, [1] t_compute (GPU), [2] pg_free, [3] all-gather
        stream ready, [4] previous copy-out (GPU implicit prefetch, -1 none),
        [5] compute total, [6] comm total, [7] last reduce-scatter end
    k (int64): [0] bytes alive, [1] peak, [2] events written, [3] memory
        samples, [4] [5] head and tail of the in-flight reduce-scatter queue (GPU),
        [6] unsharded parameter bytes alive, [7] their peak
    state (int64, per module): 0 sharded, 1 pending all-gather, 2 unsharded
    pend (int64): [0] count, then the pending modules in issue order
    ag_ev (int64, per module): trace row of its last all-gather (-1 none)
Trace kinds: 0 forward, 1 backward, 2 optimizer, 3 all-gather,
    4 reduce-scatter, 5 CPU wait.
"""

from __future__ import annotations

import numpy as np

try:  # a compiled kernel where the profile says so: see [Note: Speed]
    from numba import njit
except ImportError:  # pragma: no cover - numba is a dependency; stay correct without it
    def njit(*args, **kwargs):
        if args and callable(args[0]):
            return args[0]
        return lambda f: f

SHARDED, PENDING, UNSHARDED = 0, 1, 2


@njit(cache=True)
def _event(ev, k, kind, module, start, end):
    if ev.shape[0] > 1:
        n = k[2]
        ev[n, 0] = kind
        ev[n, 1] = module
        ev[n, 2] = start
        ev[n, 3] = end
        k[2] = n + 1


@njit(cache=True)
def _mem(s, k, mem, delta):
    alive = k[0] + delta
    k[0] = alive
    if alive > k[1]:
        k[1] = alive
    if mem.shape[0] > 1:
        n = k[3]
        mem[n, 0] = max(s[0], s[1])
        mem[n, 1] = alive
        k[3] = n + 1


@njit(cache=True)
def _unshard(i, s, k, state, ag_end, ag, ub, gpu, cpu_blocks, comm_scale, latency, ev, mem, pend, ag_ev):
    # FSDPParamGroup.unshard (callers skip modules already pending/unsharded)
    issue = s[0]
    if gpu and s[3] > issue:
        issue = s[3]
    start = issue if issue > s[2] else s[2]
    end = start + ag[i] * comm_scale + latency
    s[2] = end
    s[6] += ag[i] * comm_scale + latency
    _mem(s, k, mem, ub[i])  # foreach_all_gather allocates the output when issued
    k[6] += ub[i]
    if k[6] > k[7]:
        k[7] = k[6]
    if pend.shape[0] > 1:  # kept only where compute can slow collectives (_delay_in_flight)
        ag_ev[i] = k[2] if ev.shape[0] > 1 else -1
        pend[0] += 1
        pend[pend[0]] = i
    _event(ev, k, 3, i, start, end)
    if cpu_blocks:  # [Note: CPU device] a sync collective blocks the thread
        s[0] = end
    state[i] = PENDING
    ag_end[i] = end


@njit(cache=True)
def _wait(i, forward, s, k, state, ag_end, gpu, async_op, ev, pend):
    # FSDPParamGroup.wait_for_unshard (callers check the module is pending)
    for q in range(1, pend[0] + 1):
        if pend[q] == i:
            for r in range(q, pend[0]):
                pend[r] = pend[r + 1]
            pend[0] -= 1
            break
    end = ag_end[i]
    if gpu:
        if end > s[1]:
            s[1] = end
        if forward and not async_op:
            # Implicit prefetch keeps two all-gather outputs alive: the
            # all-gather streams wait for the previous copy-out before the next
            # all-gather ([Note: Overlapping all-gather copy-in and all-gather]).
            if s[4] >= 0 and s[4] > s[3]:
                s[3] = s[4]
            s[4] = s[1] if s[1] > s[0] else s[0]
    elif end > s[0]:
        _event(ev, k, 5, i, s[0], end)
        s[0] = end
    state[i] = UNSHARDED


@njit(cache=True)
def _reshard(i, s, k, state, ag_end, ub, gpu, async_op, ev, mem, pend):
    # FSDPParamGroup.reshard: frees the unsharded parameters; a stray
    # prefetch still pending is waited on first.
    if state[i] == PENDING:
        _wait(i, False, s, k, state, ag_end, gpu, async_op, ev, pend)
    _mem(s, k, mem, -ub[i])
    k[6] -= ub[i]
    state[i] = SHARDED


@njit(cache=True)
def _delay_in_flight(since, delay, s, ag_end, pend, ag_ev, ev):
    # Every collective still in flight after ``since`` ends ``delay`` later
    # (the process group runs them one after another; queued ones start later).
    s[2] += delay
    for q in range(1, pend[0] + 1):
        j = pend[q]
        if ag_end[j] > since:
            ag_end[j] += delay
            row = ag_ev[j]
            if row >= 0:
                if ev[row, 2] > since:
                    ev[row, 2] += delay
                ev[row, 3] += delay


@njit(cache=True)
def _compute(i, kind, ms, s, k, gpu, slow, ev, ag_end, pend, ag_ev):
    if gpu:
        start = s[1] if s[1] > s[0] else s[0]
        end = start + ms
        s[1] = end
    else:
        start = s[0]
        end = start + ms
        if slow != 0.0 and s[2] > start:
            # [Note: CPU device] a collective runs beside this compute: they
            # share the cores, so for the overlapped work both progress at
            # 1/overlap_slowdown of their speed. The compute ends later by
            # overlap * (slowdown - 1), and so does every collective still in
            # flight (the process group runs them one after another).
            delay = (min(s[2], end) - start) * slow
            end += delay
            _delay_in_flight(start, delay, s, ag_end, pend, ag_ev, ev)
        s[0] = end
    s[5] += end - start
    _event(ev, k, kind, i, start, end)


@njit(cache=True)
def step(
    ag, rs, fwd, bwd, ub, gb, ab, children, post, root, root_post_index,
    root_fwd_pre, root_fwd_post, root_bwd_pre, root_bwd_post, root_ab_pre,
    gpu, microbatches, opt_ms,
    fwd_off, fwd_tgt, bwd_off, bwd_tgt, raf, async_op, rs_cap, reshard_after_backward,
    overhead, slow, comm_scale, latency, s, k, ev, mem,
):
    """Simulate one step; fills ``s``/``k`` (and ``ev``/``mem`` if larger than 1 row)."""
    n = ag.shape[0]
    state = np.zeros(n, np.int64)
    ag_end = np.zeros(n)
    # The pending all-gathers in issue order: only where an overlap can slow them (CPU, async, slowdown).
    track = (not gpu) and async_op and slow != 0.0
    pend = np.zeros(n + 1 if track else 1, np.int64)
    ag_ev = np.full(n if track else 1, -1, np.int64)
    grads_alive = np.zeros(n, np.bool_)
    rs_end = np.zeros(post.shape[0] * microbatches + 1)
    rs_bytes = np.zeros(post.shape[0] * microbatches + 1, np.int64)
    rs_head = 0
    rs_tail = 0
    cpu_blocks = (not gpu) and (not async_op)
    s[4] = -1.0
    for mb in range(microbatches):
        last = mb == microbatches - 1
        # -- forward: root pre-forward, root head, blocks, root tail ----------
        for j in range(-1, children.shape[0]):
            i = root if j < 0 else children[j]
            # FSDPState._pre_forward -> FSDPParamGroup.pre_forward, then the
            # explicit forward prefetch (FSDPParamGroup._prefetch_unshard).
            s[0] += overhead
            if state[i] == SHARDED:
                _unshard(i, s, k, state, ag_end, ag, ub, gpu, cpu_blocks, comm_scale, latency, ev, mem, pend, ag_ev)
            if state[i] == PENDING:
                _wait(i, True, s, k, state, ag_end, gpu, async_op, ev, pend)
            for p in range(fwd_off[i], fwd_off[i + 1]):
                t = fwd_tgt[p]
                if state[t] == SHARDED:
                    _unshard(t, s, k, state, ag_end, ag, ub, gpu, cpu_blocks, comm_scale, latency, ev, mem, pend, ag_ev)
            if j < 0:
                if root_fwd_pre > 0:
                    _compute(i, 0, root_fwd_pre, s, k, gpu, slow, ev, ag_end, pend, ag_ev)
                _mem(s, k, mem, root_ab_pre)
                continue
            _compute(i, 0, fwd[i], s, k, gpu, slow, ev, ag_end, pend, ag_ev)
            _mem(s, k, mem, ab[i])  # saved for backward
            # FSDPParamGroup.post_forward: reshard if reshard_after_forward
            s[0] += overhead
            if raf[i] and state[i] != SHARDED:
                _reshard(i, s, k, state, ag_end, ub, gpu, async_op, ev, mem, pend)
        if root_fwd_post > 0:
            _compute(root, 0, root_fwd_post, s, k, gpu, slow, ev, ag_end, pend, ag_ev)
        _mem(s, k, mem, ab[root] - root_ab_pre)
        s[0] += overhead
        if raf[root] and state[root] != SHARDED:
            _reshard(root, s, k, state, ag_end, ub, gpu, async_op, ev, mem, pend)
        # -- backward in reverse post-forward order: the root's pre-backward
        # fires first (its output's gradient), its post-backward last (final
        # callback). Without gradient sync, set_reshard_after_backward decides.
        reshard_after = last or reshard_after_backward
        for index in range(post.shape[0], -1, -1):
            if index == post.shape[0]:
                i = root
                post_index = root_post_index
            else:
                i = post[index]
                post_index = index
                if i == root:
                    continue
            # FSDPState._pre_backward -> FSDPParamGroup.pre_backward; the
            # explicit list, else FSDPParamGroup._backward_prefetch.
            s[0] += overhead
            if state[i] == SHARDED:
                _unshard(i, s, k, state, ag_end, ag, ub, gpu, cpu_blocks, comm_scale, latency, ev, mem, pend, ag_ev)
            if state[i] == PENDING:
                _wait(i, False, s, k, state, ag_end, gpu, async_op, ev, pend)
            if bwd_off[i + 1] > bwd_off[i]:
                for p in range(bwd_off[i], bwd_off[i + 1]):
                    t = bwd_tgt[p]
                    if state[t] == SHARDED:
                        _unshard(t, s, k, state, ag_end, ag, ub, gpu, cpu_blocks, comm_scale, latency, ev, mem, pend, ag_ev)
            elif post_index > 0 and state[post[post_index - 1]] == SHARDED:
                _unshard(post[post_index - 1], s, k, state, ag_end, ag, ub, gpu, cpu_blocks, comm_scale, latency, ev, mem, pend, ag_ev)
            if i == root:
                if root_bwd_pre > 0:
                    _compute(i, 1, root_bwd_pre, s, k, gpu, slow, ev, ag_end, pend, ag_ev)
                continue
            _backward(i, bwd[i], last, reshard_after, s, k, state, ag_end, ub, gb, ab, rs, grads_alive,
                      rs_end, rs_bytes, rs_head, rs_tail, rs_cap, gpu, async_op, overhead, slow, comm_scale, latency, ev, mem,
                      pend, ag_ev)
            rs_head, rs_tail = int(k[4]), int(k[5])
        _backward(root, root_bwd_post, last, reshard_after, s, k, state, ag_end, ub, gb, ab, rs, grads_alive,
                  rs_end, rs_bytes, rs_head, rs_tail, rs_cap, gpu, async_op, overhead, slow, comm_scale, latency, ev, mem,
                  pend, ag_ev)
        rs_head, rs_tail = int(k[4]), int(k[5])
    # FSDPState._root_post_backward_final_callback: wait for every reduce-scatter.
    if gpu:
        if s[7] > s[1]:
            s[1] = s[7]
        for q in range(rs_head, rs_tail):
            _mem(s, k, mem, -rs_bytes[q])
    elif s[7] > s[0]:
        s[0] = s[7]
    if opt_ms > 0:
        _compute(root, 2, opt_ms, s, k, gpu, slow, ev, ag_end, pend, ag_ev)


@njit(cache=True)
def _backward(i, ms, reduce, reshard_after, s, k, state, ag_end, ub, gb, ab, rs, grads_alive,
              rs_end, rs_bytes, rs_head, rs_tail, rs_cap, gpu, async_op, overhead, slow, comm_scale, latency, ev, mem,
              pend, ag_ev):
    if not grads_alive[i]:  # autograd allocates the unsharded gradient once
        grads_alive[i] = True
        _mem(s, k, mem, gb[i])
    _compute(i, 1, ms, s, k, gpu, slow, ev, ag_end, pend, ag_ev)
    _mem(s, k, mem, -ab[i])
    # FSDPParamGroup.post_backward: reshard, then reduce-scatter (only with
    # gradient sync, set_requires_gradient_sync).
    s[0] += overhead
    if reshard_after and state[i] != SHARDED:
        _reshard(i, s, k, state, ag_end, ub, gpu, async_op, ev, mem, pend)
    if reduce:
        if gpu:
            # reduce_scatter_max_input_buffers: the compute stream waits on the
            # oldest reduce-scatter before reusing its input buffer.
            while rs_tail - rs_head >= rs_cap:
                if rs_end[rs_head] > s[1]:
                    s[1] = rs_end[rs_head]
                _mem(s, k, mem, -rs_bytes[rs_head])
                rs_head += 1
            issue = s[1] if s[1] > s[0] else s[0]
            start = issue if issue > s[2] else s[2]
            end = start + rs[i] * comm_scale + latency
            s[2] = end
        else:
            start = s[0] if s[0] > s[2] else s[2]
            end = start + rs[i] * comm_scale + latency
            s[2] = end
        s[6] += rs[i] * comm_scale + latency
        _event(ev, k, 4, i, start, end)
        grads_alive[i] = False
        if gpu:
            rs_end[rs_tail] = end
            rs_bytes[rs_tail] = gb[i]
            rs_tail += 1
        else:
            s[0] = end  # [Note: CPU device] the reduce-scatter is synchronous
            _mem(s, k, mem, -gb[i])
        s[7] = end
    k[4] = rs_head
    k[5] = rs_tail
