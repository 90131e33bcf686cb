import collections, torch
import autopar
from tests.distributed import run_ranks
from tests.test_parallelize import _workload, _optimizer
NAME = "mlp-tiny"
def f(rank, world):
    from torch.distributed.tensor.debug import CommDebugMode
    w, batches = _workload(NAME)
    pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, optimizer=_optimizer, plan="1,2,1")
    with CommDebugMode() as cm:
        pm.step(*batches[0])
    return {str(k): v for k, v in cm.get_comm_counts().items()}, pm.graph.unplanned
if __name__ == "__main__":
    import pathlib, tempfile
    from autopar.intra_op import shard_stage
    from autopar.manual import MEGATRON
    from cost_models import get_cluster
    w, _ = _workload(NAME)
    pred = shard_stage(autopar.capture(w.model, w.example_inputs), get_cluster("cpu-local").with_mesh(1, 2), (1, 2), (1, 2), rule=MEGATRON).collectives
    for c in pred: print(c)
    print(collections.Counter((c["kind"], c["phase"]) for c in pred))
    print(run_ranks(f, 2, pathlib.Path(tempfile.mkdtemp()))[0])
