"""What pyproject.toml cannot say declaratively: the package layout.

Installing kvserve adds exactly one top-level import package, `kvserve`. Its root is
protos/kvserve (the generated stubs live beside their .proto files), and each service folder of
the repository is one subpackage of it:

    protos/kvserve/    -> kvserve             (kvserve.kvcache.v1, kvserve.inference.v1)
    services/          -> kvserve.services
    kvcache_service/   -> kvserve.kvcache_service
    model_service/     -> kvserve.model_service
    clients/           -> kvserve.clients
"""

from setuptools import find_packages, setup

FOLDERS = {
    "kvserve": "protos/kvserve",
    "kvserve.services": "services",
    "kvserve.kvcache_service": "kvcache_service",
    "kvserve.model_service": "model_service",
    "kvserve.clients": "clients",
}


def packages() -> list[str]:
    found = []
    for root, folder in FOLDERS.items():
        found.append(root)
        found += [f"{root}.{sub}" for sub in find_packages(folder)]
    return sorted(set(found))


setup(
    package_dir=FOLDERS,
    packages=packages(),
    package_data={"": ["*.proto", "*.pyi", "*.c"]},
)
