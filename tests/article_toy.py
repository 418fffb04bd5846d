"""A transcription of the article's toy code (shared/seeds/000_f3a9c4641639ea73.txt), kept as the
reference that normexp must reproduce bit for bit.

Only the hard-coded values became parameters (seed, depth, width, steps, lr, n_samples, n_class);
every line that touches a tensor is the article's, in the article's order.
"""

import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * x / x.pow(2).mean(-1, keepdim=True).add(self.eps).sqrt()


def make_norm(kind, d):
    return torch.nn.LayerNorm(d) if kind == 'LN' else RMSNorm(d)


def xavier(lin):
    torch.nn.init.xavier_uniform_(lin.weight)
    torch.nn.init.zeros_(lin.bias)
    return lin


class Net(torch.nn.Module):
    def __init__(self, N, d, placement, kind='LN', n_class=10):
        super().__init__()
        self.placement = placement  # 'Post' or 'Pre'
        self.norms = torch.nn.ModuleList([make_norm(kind, d) for _ in range(N)])
        self.fc1 = torch.nn.ModuleList([xavier(torch.nn.Linear(d, 4 * d)) for _ in range(N)])
        self.fc2 = torch.nn.ModuleList([xavier(torch.nn.Linear(4 * d, d)) for _ in range(N)])
        self.final_norm = make_norm(kind, d)
        self.head = xavier(torch.nn.Linear(d, n_class))

    def forward(self, x):
        for norm, fc1, fc2 in zip(self.norms, self.fc1, self.fc2):
            if self.placement == 'Pre':
                x = x + fc2(torch.relu(fc1(norm(x))))
            else:
                x = norm(x + fc2(torch.relu(fc1(x))))
        return self.head(self.final_norm(x))


def train_losses(placement, kind, N, d, steps, lr, seed=0, n_samples=64, n_class=10):
    torch.manual_seed(seed)
    model = Net(N, d, placement, kind, n_class)
    X = torch.randn(n_samples, d)
    y = torch.randint(0, n_class, (n_samples,))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps + 1):
        loss = torch.nn.functional.cross_entropy(model(X), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


# The article's printed table (its own machine and torch build): step -> (Post-LN, Post-RMS, Pre-LN, Pre-RMS)
ARTICLE_TABLE = {
    0: (2.7399, 2.7438, 2.6015, 2.6482),
    1: (3.2239, 3.4183, 2.9216, 3.0025),
    2: (2.8667, 2.9987, 2.5541, 2.4276),
    3: (2.5200, 2.6105, 2.2131, 2.1588),
    5: (2.2596, 2.2676, 1.8619, 1.8424),
    10: (2.2218, 2.2416, 0.9175, 0.8868),
    20: (2.2087, 2.2087, 0.0920, 0.0637),
    30: (2.2052, 2.2034, 0.0201, 0.0121),
}
