from setuptools import find_packages, setup

setup(
    name="deadpool-megatron",
    version="0.1.0",
    description="Hot-swap fault tolerance for Megatron-Core training (DeadPool method).",
    packages=find_packages(include=["deadpool_megatron", "deadpool_megatron.*"]),
    # the goodput simulator's calibration input (tools/bench_recovery.py's measurement)
    package_data={"deadpool_megatron.goodput": ["measured/*.json"]},
    python_requires=">=3.11",
    # megatron-core 0.19.2 declares Python >=3.12; on 3.11 install it with
    # `pip install --no-deps --ignore-requires-python megatron-core==0.19.2` (tools/setup_env.sh).
    install_requires=["torch>=2.6", "numpy", "packaging>=24.2", "psutil", "crc32c>=2.4",
                      "megatron-core==0.19.2"],
    extras_require={
        # GPU extras, used when present; nothing on CPU needs them. apex is not on PyPI (the
        # PyPI package named apex is unrelated): build NVIDIA apex from source, see README.
        "gpu": ["transformer-engine[pytorch]"],
        "test": ["pytest"],
        # deadpool-report --png (the table needs nothing more).
        "report": ["matplotlib>=3.7"],
    },
    entry_points={"console_scripts": [
        "deadpool-launch=deadpool_megatron.launch.launcher:main",
        "deadpool-patch=deadpool_megatron.patching.cli:main",
        "deadpool-report=deadpool_megatron.metrics.cli:main",
        "deadpool-inject=deadpool_megatron.faults.cli:main",
    ]},
)
