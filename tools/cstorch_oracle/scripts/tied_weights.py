"""A tied-embedding LM (``lm_head.weight`` is ``embedding.weight``) sparsified through a filter
that names the tied weight by its second alias only, by a glob, by a callable, by a glob that
names both, and by an algorithm applied directly: the parameters sparsified, under which name,
the zeros of the tied weight after two steps, the masks. ``record`` is provided by the harness."""

import torch

import cerebras.pytorch as cstorch

backend = cstorch.backend("CPU")


class TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(16, 8)
        self.body = torch.nn.Linear(8, 8)
        self.lm_head = torch.nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.embedding.weight

    def forward(self, tokens):
        return self.lm_head(torch.tanh(self.body(self.embedding(tokens))))


CASES = {
    "second_alias_glob": lambda: cstorch.sparse.configure(
        {"algorithm": "static", "sparsity": 0.5, "param_filter": "lm_head.weight"}),
    "second_alias_callable": lambda: cstorch.sparse.Group(
        {lambda name, param: name.startswith("lm_head"): cstorch.sparse.Static(sparsity=0.5)}),
    "second_alias_with_body": lambda: cstorch.sparse.configure(
        {"algorithm": "set", "sparsity": 0.5, "param_filter": ["lm_head.*", "body.weight"]}),
    "both_aliases": lambda: cstorch.sparse.configure({"algorithm": "static", "sparsity": 0.5,
                                                      "param_filter": "*.weight"}),
    "direct": lambda: cstorch.sparse.Static(sparsity=0.5),
}

for case, make in CASES.items():
    torch.manual_seed(8)
    model = TiedLM()
    sparsity = make()
    sparsity.apply(model)
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.apply(sparsity)
    sparsity.initialize()
    record(f"{case}/sparse_names", sorted(sparsity.sparse_params))
    tokens = torch.Generator().manual_seed(9)
    for step in range(2):
        inputs = torch.randint(0, 16, (4, 5), generator=tokens)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs).reshape(-1, 16), inputs.reshape(-1))
        loss.backward()
        optimizer.step()
        record(f"{case}/loss", loss)
    record(f"{case}/tied_zeros", int((model.embedding.weight == 0).sum()))
    record(f"{case}/masks", {n: b for n, b in model.named_buffers() if n.endswith("_mask")})
