"""Start-up: which device and backend each rank takes (GPU counts injected; no GPU needed)."""

import os
import unittest
from unittest import mock

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

    def test_one_gpu_per_process_is_cuda_0_whatever_the_local_rank(self):
        # srun --gpus-per-task=1: CUDA_VISIBLE_DEVICES names one GPU per task, so every task
        # sees one device, its own, as cuda:0 (LOCAL_WORLD_SIZE counts the node's tasks)
        for local_rank in range(4):
            for local_world_size in (None, 4):
                with self.subTest(local_rank=local_rank, local_world_size=local_world_size):
                    self.assertEqual(
                        pick_device_and_backend(local_rank, local_world_size, cuda_available=True,
                                                device_count=1, shared_devices=False),
                        (torch.device("cuda", 0), "nccl"))

    def test_one_gpu_shared_by_torchruns_workers_is_still_refused(self):
        # torchrun gives every worker the same CUDA_VISIBLE_DEVICES: four workers, one GPU
        with self.assertRaisesRegex(ValueError, "local rank 1 .*LOCAL_WORLD_SIZE=4.* sees 1"):
            pick_device_and_backend(1, 4, cuda_available=True, device_count=1, shared_devices=True)
        self.assertEqual(
            pick_device_and_backend(0, 1, cuda_available=True, device_count=1, shared_devices=True),
            (torch.device("cuda", 0), "nccl"))

    def test_torchrun_is_taken_to_share_devices_and_srun_not(self):
        # the default of shared_devices: TORCHELASTIC_RUN_ID is set by torchrun only
        with mock.patch.dict(os.environ, {"TORCHELASTIC_RUN_ID": "job"}):
            with self.assertRaises(ValueError):
                pick_device_and_backend(1, 2, cuda_available=True, device_count=1)
        with mock.patch.dict(os.environ):
            os.environ.pop("TORCHELASTIC_RUN_ID", None)
            self.assertEqual(
                pick_device_and_backend(1, 2, cuda_available=True, device_count=1)[0],
                torch.device("cuda", 0))

    def test_device_id_is_passed_to_the_process_group_on_cuda_only(self):
        self.assertEqual(process_group_options(torch.device("cuda", 3)),
                         {"device_id": torch.device("cuda", 3)})
        self.assertEqual(process_group_options(torch.device("cpu")), {})


if __name__ == "__main__":
    unittest.main()
