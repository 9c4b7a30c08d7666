"""What developers and CI run, outside the package users import to serve: the SGLang wheel's
loader (``sglang_wheel``), the adapter's conformance checks against SGLang's source
(``sglang_conformance``, ``sglang_dcp_conformance``) and the interpreter's count of memory
operations a GPU would wait for (``critical_path``). ``make test`` runs them through ``tests/``;
``import ulakv`` loads none of them (``tests/test_design_doc.py`` checks)."""
