"""Start-up: which device and backend each rank takes (GPU counts injected; no GPU needed)."""

import unittest

import torch

from scaletorch.dist import pick_device_and_backend
from scaletorch.dist.init import process_group_options


class EachRankGetsADeviceOfItsOwn(unittest.TestCase):

    def test_without_cuda_every_rank_is_cpu_and_gloo(self):
        for local_rank in range(4):
            self.assertEqual(pick_device_and_backend(local_rank, 4, cuda_available=False),
                             (torch.device("cpu"), "gloo"))

    def test_with_enough_gpus_local_rank_r_takes_gpu_r_with_nccl(self):
        for local_rank in range(4):
            device, backend = pick_device_and_backend(local_rank, 4, cuda_available=True,
                                                      device_count=8)
            self.assertEqual((device.type, device.index, backend), ("cuda", local_rank, "nccl"))

    def test_more_ranks_than_gpus_is_refused_by_every_rank_naming_the_numbers(self):
        # rank 0 too: LOCAL_WORLD_SIZE=4 > 2 GPUs, so no rank of the node goes on to hang
        for local_rank in range(4):
            with self.assertRaises(ValueError) as caught:
                pick_device_and_backend(local_rank, 4, cuda_available=True, device_count=2)
            message = str(caught.exception)
            for part in (f"local rank {local_rank}", "LOCAL_WORLD_SIZE=4",
                         "torch.cuda.device_count()=2", "--nproc-per-node 2",
                         "CUDA_VISIBLE_DEVICES"):
                self.assertIn(part, message)

    def test_without_local_world_size_a_rank_past_the_last_gpu_is_refused(self):
        self.assertEqual(
            pick_device_and_backend(1, cuda_available=True, device_count=2)[0],
            torch.device("cuda", 1))
        with self.assertRaisesRegex(ValueError, "local rank 2 .* sees 2"):
            pick_device_and_backend(2, cuda_available=True, device_count=2)

    def test_device_id_is_passed_to_the_process_group_on_cuda_only(self):
        self.assertEqual(process_group_options(torch.device("cuda", 3)),
                         {"device_id": torch.device("cuda", 3)})
        self.assertEqual(process_group_options(torch.device("cpu")), {})


if __name__ == "__main__":
    unittest.main()
