"""Topology detection from each launcher's variables."""
import pytest

from dualframe import Topology, TopologyError, detect_topology


def test_no_launcher_is_one_process():
    assert detect_topology({}) == Topology(0, 1, 0, 1, 0, 1, "none")


def test_horovodrun_variables():
    env = {"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
           "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}
    assert detect_topology(env) == Topology(3, 4, 1, 2, 1, 2, "horovodrun")


def test_open_mpi_variables_derive_the_node():
    env = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert detect_topology(env) == Topology(5, 8, 1, 4, 1, 2, "mpirun")


def test_open_mpi_map_by_node_deals_ranks_round_robin_over_the_nodes():
    # What `mpirun -np 4 -H n1:2,n2:2 --map-by node` sets (seen on the test cluster): rank 1 is on n2.
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_orte_num_nodes": "2", "OMPI_MCA_rmaps_base_mapping_policy": "node"}
    assert detect_topology(env) == Topology(1, 4, 0, 2, 1, 2, "mpirun")
    assert detect_topology(dict(env, OMPI_MCA_rmaps_base_mapping_policy="slot")).cross_rank == 0  # block: 0, 1 on n1


def test_pmi_variables():
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    assert detect_topology(env) == Topology(2, 4, 0, 2, 1, 2, "pmi")


def test_slurm_step_variables():
    env = {"SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "6", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "2", "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_TASKS_PER_NODE": "2(x3)"}
    assert detect_topology(env) == Topology(5, 6, 1, 2, 2, 3, "slurm")


def test_uneven_slurm_tasks_per_node():
    env = {"SLURM_PROCID": "4", "SLURM_STEPID": "1", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "2", "SLURM_NNODES": "3", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert detect_topology(env).local_size == 1


def test_batch_script_without_srun_is_one_process():
    assert detect_topology({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}).size == 1


def test_malformed_variable_is_named():
    with pytest.raises(TopologyError, match=r"OMPI_COMM_WORLD_SIZE must be an integer .*'two'"):
        detect_topology({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "two"})


def test_rank_outside_size_is_refused():
    with pytest.raises(TopologyError, match=r"rank must be in \[0, size\) \(rank: 4, size: 4\)"):
        detect_topology({"HOROVOD_RANK": "4", "HOROVOD_SIZE": "4"})
