"""The multi-node launch path, as two torchrun agents on localhost forming one job."""





from tests.helpers import REPO


def test_slurm_and_k8s_use_the_same_launcher():
    assert "launch.sh" in (REPO / "scripts" / "slurm.sbatch").read_text()
    assert "scripts/launch.sh" in (REPO / "scripts" / "k8s" / "trainlib-job.yaml").read_text()


