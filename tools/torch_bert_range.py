"""One steady-state torch.compile BERT-base call between cudaProfilerStart/Stop, for ncu.
python3 tools/torch_bert_range.py [BATCH SEQ] (default 1 9)."""
import sys
import torch
from transformers import BertConfig, BertModel
batch, seq = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (1, 9)
with torch.no_grad():
    bert = BertModel(BertConfig()).cuda().eval()
    ids = torch.randint(0, 30522, (batch, seq), device="cuda")
    g = torch.compile(bert)
    for _ in range(5):
        g(ids)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    g(ids)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
