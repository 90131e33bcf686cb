import sys, dataclasses
from tests.constructs import workload
from autopar.planner import Search
from cost_models import get_cluster
for kind in sys.argv[1:]:
    w = workload(kind)
    s = Search.start(w, dataclasses.replace(get_cluster("cpu-local"), devices_per_host=2), (1, 2))
    print(kind, [(l.name, l.flops, str(s.costs.hashes[i])[-6:]) for i, l in enumerate(s.layers)])
