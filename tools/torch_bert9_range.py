"""One steady-state torch.compile BERT-base 1x9 call between cudaProfilerStart/Stop, for ncu."""
import torch
from transformers import BertConfig, BertModel
with torch.no_grad():
    bert = BertModel(BertConfig()).cuda().eval()
    ids = torch.randint(0, 30522, (1, 9), device="cuda")
    g = torch.compile(bert)
    for _ in range(5):
        g(ids)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    g(ids)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
