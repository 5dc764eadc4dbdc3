import os

import torch

torch.set_num_threads(1)  # spawned ranks share the 2 cores; keep the parent off them

# (world_size, tp): the layouts every distributed test body runs at (GUIDE section 4)
LAYOUTS = [(1, 1), (2, 2), (2, 1), (4, 4), (4, 2)]
