"""``kvlifecycle bench gpu-layerwise``: layer-wise streaming against the post-prefill copy, worker side, in one run.

P (this process) runs a prefill stand-in (:mod:`.model`: a decoder layer's matmuls at a Llama-3-8B-like shape,
each layer writing its K and V into vLLM-shaped bf16 caches) on a compute stream; D (:mod:`.target`, a spawned
process on the same GPU) owns caches of the same shape, exported through CUDA IPC, which P maps and WRITEs into
with ``kvlifecycle.transports.cuda_ipc``. Streaming posts each layer's K and V regions right after that layer,
ordered after it by an event (:mod:`.ordering`); the post-prefill baseline posts every layer's K and V at once
after the last layer; a third mode runs the prefill alone.

**T_visible** is the time from the last layer's compute done to all of D's blocks landed: in device time (the
last layer's event → the end of the last copy on the transport's stream), as P's host sees it (both spun on), and
as D sees it (its notification's arrival on D's host clock). Reported per prompt length beside the prefill's
own time in each mode, so what streaming costs the prefill shows too. With ``--cpu`` the same runs go over NIXL
on DRAM (no device time): how the harness is tested without a GPU.

Modules: :mod:`.model`, :mod:`.ordering`, :mod:`.target` (D) and :mod:`.run` (modes, repetitions, the JSON).
"""

from .run import add_arguments, measure, run

__all__ = ["add_arguments", "measure", "run"]
