import os

import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

# (world_size, tp): the layouts every distributed test body runs at (GUIDE section 4)
LAYOUTS = [(1, 1), (2, 2), (2, 1), (4, 4), (4, 2)]
