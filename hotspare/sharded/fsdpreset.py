"""FSDP2's per-iteration state put back after a failed step (torch 2.13)."""
from __future__ import annotations


def reset_fsdp(module) -> None:
    """FSDP2's own recovery after a failed forward/backward (torch 2.13 ``reset_iter_state``).
    It waits for the all-gather in flight, whose group is aborted by now: its error is
    expected; the wait is then dropped and the reset run again."""
    for _ in range(8):
        try:
            module.reset_iter_state()
            break
        except Exception:       # noqa: BLE001 - the aborted generation's collective
            state = module._get_fsdp_state()
            ctx = state._comm_ctx
            ctx.all_gather_state = None
            for s in state._state_ctx.all_states:
                for pg in s._fsdp_param_groups:
                    pg._all_gather_result = None
    else:
        module.reset_iter_state()
    # reset_iter_state leaves the gradients autograd wrote into unsharded parameters before the
    # backward failed (a param group whose post-backward never ran): the re-run's backward would
    # add to them. Found by HSDP's failover test (a survivor's backward stopped in the
    # replicate all-reduce): drop them.
    for s in module._get_fsdp_state()._state_ctx.all_states:
        for pg in s._fsdp_param_groups:
            for fp in pg.fsdp_params:
                if hasattr(fp, "_unsharded_param"):
                    fp._unsharded_param.grad = None
                fp.unsharded_accumulated_grad = None


__all__ = ["reset_fsdp"]
