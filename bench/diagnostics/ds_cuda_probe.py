import os, torch, fusion_compiler as fc
from fusion_compiler.model_adapters import get_adapter, make_decode_step
from fusion_compiler.passes import fusion_pass as fp
out = os.environ.get("OUT", "/tmp")
orig = fp.FusionPass.__call__
def patched(self, graph):
    before = str(graph)
    open(f'{out}/graph_before_{len(self.report.graphs)}.txt','w').write(before)
    orig(self, graph)
fp.FusionPass.__call__ = patched
adapter = get_adapter("deepseek-v3.2")
for size, batch in (("tiny", 1),):
    model = adapter.build_hf(size=size, layers=1, device="cuda", dtype=torch.bfloat16, seed=0)
    backend = fc.FusionBackend(fc.FusionConfig())
    compiled = torch.compile(model, backend=backend)
    step = make_decode_step(model, batch=batch, context=16, seed=3, max_cache_len=32)
    step.run(compiled)
    print(size, batch, backend.report.summary())
    for s in backend.report.sites:
        if s.family == "dsa_topk_mask": print(s)
