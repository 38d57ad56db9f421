#!/usr/bin/env python3
"""Writes seed corpora for the fuzz targets: OUT/safetensors_header_fuzz
(small safetensors files, valid and subtly broken), and, using the dcr binary
given as argv[2], OUT/frame_fuzz (single frames of real deltas in every mode)
and OUT/manifest_fuzz (their manifests); for the object stores,
OUT/s3_xml_fuzz (S3 XML replies as AWS and radosgw send them),
OUT/s3_response_fuzz (scripted S3 exchanges) and OUT/store_config_fuzz
(store URLs, AWS environment and profile files, fault specs); for layout
maps, OUT/layout_map_fuzz (valid and subtly broken maps); for the refit
protocol, OUT/records_fuzz (store records: run, commit, ack, receiver,
snapshot, trainer process, attempt, fence; the first byte picks the type),
OUT/contribution_fuzz (contribution objects, dummy checksums: the target
recomputes them when byte 0 says so) and OUT/journals_fuzz (the
receivers' local journals). Standard library only.

usage: seeds.py OUT DCR_BINARY
"""
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile


def safetensors(tensors, metadata=None, pad=True, data_extra=b""):
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    data = b""
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        data += bytes((offset + i) & 0xFF for i in range(nbytes))
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data + data_extra


def delta_seeds(dcr, frames_out, manifests_out):
    """Small deltas in both classes; every frame becomes one seed file."""
    os.makedirs(frames_out, exist_ok=True)
    os.makedirs(manifests_out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([dcr, "gen", "-o", f"{tmp}/g", "--family", "deepseek-v3", "--size", "1MB",
                        "--versions", "1", "--rate", "0.05", "--seed", "5"], check=True, capture_output=True)
        # Binary manifests with their tensor tables, from a model of few tensors
        # (the table is in every input), as checked and as resealed inputs.
        subprocess.run([dcr, "gen", "-o", f"{tmp}/small", "--family", "llama", "--size", "256KB",
                        "--versions", "1", "--rate", "0.05", "--seed", "6"], check=True, capture_output=True)
        for mode, chunk in (("xor", "4096"), ("overwrite", "8192"), ("xor", "65536")):
            d = f"{tmp}/b-{mode}-{chunk}"
            subprocess.run([dcr, "delta", "make", f"{tmp}/small/v0", f"{tmp}/small/v1", "-o", d, "--mode", mode,
                            "--chunk", chunk], check=True, capture_output=True)
            table = json.dumps(json.load(open(f"{d}/tensors.json")), separators=(",", ":")).encode()
            manifest = open(f"{d}/manifest.bin", "rb").read()
            for variant, flag in (("checked", 0), ("resealed", 1 << 31)):
                with open(os.path.join(manifests_out, f"binary-{mode}-{chunk}-{variant}"), "wb") as f:
                    f.write(struct.pack("<I", len(table) | flag) + table + manifest)
        n = 0
        for mode, chunk, extra in (("xor", "4096", []), ("xor", "65536", ["--no-add"]), ("overwrite", "2048", [])):
            d = f"{tmp}/d-{mode}-{chunk}-{len(extra)}"
            subprocess.run([dcr, "delta", "make", f"{tmp}/g/v0", f"{tmp}/g/v1", "-o", d, "--mode", mode,
                            "--chunk", chunk, *extra], check=True, capture_output=True)
            doc = json.loads(subprocess.run([dcr, "delta", "inspect", d, "--manifest"], check=True,
                                            capture_output=True).stdout)
            # Not the whole manifest (150 KB, hundreds of tensors): every entry
            # takes the same parser paths, and inputs that large make each
            # execution ~100x slower (manifest_fuzz.options caps -max_len).
            medium = dict(doc, tensors=doc["tensors"][:12], frames=[f for f in doc["frames"] if f["tensor"] < 12][:24])
            with open(os.path.join(manifests_out, f"manifest-{n}"), "w") as f:
                json.dump(medium, f, separators=(",", ":"))
            small = dict(doc, tensors=doc["tensors"][:2], frames=[f for f in doc["frames"] if f["tensor"] < 2][:3])
            with open(os.path.join(manifests_out, f"manifest-small-{n}"), "w") as f:
                json.dump(small, f)
            data = open(f"{d}/frames.bin", "rb").read()
            for entry in doc["frames"][:40]:
                frame = data[entry["offset"]:entry["offset"] + entry["bytes"]]
                if len(frame) > 64 << 10:
                    continue  # keep seeds small
                # The chunk's words, as the receiver's tensor table gives them.
                tensor = doc["tensors"][entry["tensor"]]
                numel = 1
                for dim in tensor["shape"]:
                    numel *= dim
                elements = min(int(chunk), numel - entry["chunk"] * int(chunk))
                words = elements * (2 if tensor["dtype"] == "C64" else 1)
                for variant, flags in (("checked", 0), ("resealed", 1)):
                    with open(os.path.join(frames_out, f"frame-{n}-{variant}"), "wb") as f:
                        f.write(bytes([flags]) + struct.pack("<I", words) + frame)
                n += 1


S3_NS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'
XML_DECL = '<?xml version="1.0" encoding="UTF-8"?>'

S3_XML = {
    "list": f'{XML_DECL}<ListBucketResult {S3_NS}><Name>bkt</Name><Prefix>pre/</Prefix><KeyCount>2</KeyCount>'
            '<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated><Contents><Key>pre/a/b</Key>'
            '<LastModified>2026-11-30T10:00:00.000Z</LastModified><ETag>&quot;9e107d9d372bb6826bd81d3542a419d6&quot;'
            '</ETag><Size>43</Size><StorageClass>STANDARD</StorageClass></Contents><Contents><Key>pre/a/c</Key>'
            '<ETag>"d41d8cd98f00b204e9800998ecf8427e-2"</ETag><Size>10485760</Size></Contents></ListBucketResult>',
    "list_truncated": f'{XML_DECL}<ListBucketResult {S3_NS}><Name>bkt</Name><Prefix></Prefix><IsTruncated>true'
                      '</IsTruncated><NextContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=</NextContinuationToken>'
                      '<Contents><Key>k &amp; &lt;x&gt;</Key><Size>0</Size><ETag>"x"</ETag></Contents></ListBucketResult>',
    "list_empty": f'<ListBucketResult {S3_NS}><Name>bkt</Name><KeyCount>0</KeyCount><IsTruncated>false</IsTruncated>'
                  '</ListBucketResult>',
    "error_nosuchkey": f'{XML_DECL}\n<Error><Code>NoSuchKey</Code><Message>The specified key does not exist.</Message>'
                       '<Key>pre/a</Key><RequestId>tx00000a1b2c3d4e5f-0065a1b2c3-1234-default</RequestId>'
                       '<HostId>1234-default-default</HostId></Error>',
    "error_slowdown": '<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>',
    "error_redirect": '<Error><Code>PermanentRedirect</Code><Message>The bucket you are attempting to access must be '
                      'addressed using the specified endpoint.</Message><Endpoint>bkt.s3.eu-west-1.amazonaws.com'
                      '</Endpoint><Bucket>bkt</Bucket></Error>',
    "error_signature": '<Error><Code>SignatureDoesNotMatch</Code><Message></Message><StringToSign>AWS4-HMAC-SHA256\n'
                       '20261130T100000Z\n20261130/default/s3/aws4_request\nabc</StringToSign></Error>',
    "initiate": f'{XML_DECL}<InitiateMultipartUploadResult {S3_NS}><Bucket>bkt</Bucket><Key>pre/big</Key>'
                '<UploadId>2~iCw_lDY8VoDLyGNbxpNtyGp6CJ1Ai1s</UploadId></InitiateMultipartUploadResult>',
    "complete": f'{XML_DECL}<CompleteMultipartUploadResult {S3_NS}><Location>http://127.0.0.1:7480/bkt/pre/big'
                '</Location><Bucket>bkt</Bucket><Key>pre/big</Key><ETag>"3858f62230ac3c915f300c664312c11f-2"</ETag>'
                '</CompleteMultipartUploadResult>',
    "complete_200_error": f'{XML_DECL}\n   \n<Error><Code>InternalError</Code><Message>We encountered an internal '
                          'error. Please try again.</Message></Error>',
    "cdata_comment": '<Error><!-- c --><Code><![CDATA[Slow]]>Down</Code><Message>a&#x41;&#66;</Message></Error>',
    "doctype": '<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;">]><Error><Code>&lol2;</Code></Error>',
    "escape": "~a & b <c> \"d\" 'e'\n\tf",
}


def reply(status, headers=(), body=""):
    head = "".join(f"{k}: {v}\n" for k, v in headers)
    return f"HTTP {status}\n{head}\n{body}"


def s3_response_seeds():
    # The ETag S3 gives a multipart object: MD5 of the parts' binary MD5s, "-N".
    parts_md5 = hashlib.md5(bytes.fromhex("a" * 32) + bytes.fromhex("b" * 32)).hexdigest()
    multipart_etag = f'"{parts_md5}-2"'
    md5_hello = '"5d41402abc4b2a76b9719d911017c592"'
    get = [reply(206, [("Content-Range", "bytes 0-4/5"), ("Content-Length", "5"), ("ETag", md5_hello)], "hello")]
    head = [reply(200, [("Content-Length", "5"), ("ETag", md5_hello)])]
    ok = [reply(200, [("ETag", md5_hello), ("Content-Length", "0")])]
    err = lambda status, code: reply(status, [("Content-Type", "application/xml")],
                                     f"<Error><Code>{code}</Code><Message>m</Message></Error>")
    seeds = {
        "head_get": ("H G", head + get),
        "get_whole_200": ("G", [reply(200, [("Content-Length", "5"), ("ETag", md5_hello)], "hello")]),
        "get_two_rounds": ("G", [reply(206, [("Content-Range", "bytes 0-1/5"), ("Content-Length", "2"),
                                              ("ETag", '"e1"')], "he"),
                                 reply(206, [("Content-Range", "bytes 2-4/5"), ("Content-Length", "3"),
                                             ("ETag", '"e1"')], "llo")]),
        "get_empty": ("G", [reply(416, [("Content-Range", "bytes */0")]), reply(200, [("Content-Length", "0"),
                                                                                      ("ETag", '"d41d8"')])]),
        "read_range": ("R1,3 R4,2,e R9,1", [reply(206, [("Content-Range", "bytes 1-3/5"), ("Content-Length", "3"),
                                                         ("ETag", md5_hello)], "ell"),
                                             reply(412, [], ""), reply(416, [("Content-Range", "bytes */5")])]),
        "retry_then_ok": ("G", [err(503, "SlowDown"), "timeout"] + get),
        "truncated_then_ok": ("G", [reply(200, [("Content-Length", "5")], "he")] + get),
        "drop_mid_body": ("G", [reply(206, [("Content-Range", "bytes 0-4/5"), ("Content-Length", "5"),
                                            ("ETag", md5_hello)], "hel").replace("HTTP 206", "HTTP 206 drop 2")] + get),
        "list_pages": ("L La/", [reply(200, [], S3_XML["list_truncated"]), reply(200, [], S3_XML["list"]),
                                 reply(200, [], S3_XML["list_empty"])]),
        # A server that lists keys outside the prefix asked for: not listed.
        "list_outside_prefix": ("Lx/", [reply(200, [], S3_XML["list"])]),
        "put_create": ("P5 C5 C5", ok + [err(412, "PreconditionFailed")] + head +
                       [err(412, "PreconditionFailed"), reply(404, [])]),
        "multipart": ("W9000", [reply(200, [], S3_XML["initiate"]), reply(200, [("ETag", '"a' * 1 + "0" * 31 + '"')]),
                                reply(200, [("ETag", '"' + "b" * 32 + '"')]), reply(200, [("ETag", '"' + "c" * 32 + '"')]),
                                reply(200, [], S3_XML["complete"])]),
        "multipart_lost_complete": ("W5000", [reply(200, [], S3_XML["initiate"]), reply(200, [("ETag", '"' + "a" * 32 + '"')]),
                                              reply(200, [("ETag", '"' + "b" * 32 + '"')]), "timeout",
                                              err(404, "NoSuchUpload"),
                                              reply(200, [("Content-Length", "5000"), ("ETag", multipart_etag)])]),
        "multipart_200_error": ("W5000", [reply(200, [], S3_XML["initiate"]), reply(200, [("ETag", '"' + "a" * 32 + '"')]),
                                          reply(200, [("ETag", '"' + "b" * 32 + '"')]),
                                          reply(200, [], S3_XML["complete_200_error"]), reply(200, [], S3_XML["complete"])]),
        "abort": ("W5000a", [reply(200, [], S3_XML["initiate"]), reply(200, [("ETag", '"' + "a" * 32 + '"')]),
                             reply(204, [])]),
        "errors": ("H H H D B", [reply(404, []), reply(404, []), reply(403, []), err(403, "RequestTimeTooSkewed"),
                                 err(404, "NoSuchBucket"), err(409, "BucketAlreadyOwnedByYou")]),
        "redirect": ("G", [reply(301, [("x-amz-bucket-region", "eu-west-1")], S3_XML["error_redirect"])]),
    }
    return {name: (ops + "".join("\n~~\n" + r for r in replies)).encode() for name, (ops, replies) in seeds.items()}


def store_config_seeds():
    sep = "\n--\n"
    seeds = {
        "url_local": "s" + "s3://bkt/run%2042/sub/?endpoint=http://127.0.0.1:7480/&region=default&addressing=path",
        "url_tuning": "s" + "s3://bkt?part_size=8m&parts_in_flight=4&threads=16&max_attempts=10"
                      "&create_if_absent_limit=1g&verify_tls=0&create_bucket=1",
        "url_credentials": "s" + "s3://bkt/p?access_key_id=AKIDEXAMPLE&secret_access_key=wJalr%2FXUtnFEMI"
                           "&session_token=FwoGZXIvYXdzEJr",
        "env": "s" + "s3://bkt" + sep + "AWS_ACCESS_KEY_ID=AKIDENVENV\nAWS_SECRET_ACCESS_KEY=secretsecret\n"
               "AWS_SESSION_TOKEN=tokentoken\nAWS_REGION=eu-west-1\nDCR_S3_ENDPOINT=https://s3.example.com:9000",
        "profiles": "s" + "s3://bkt?profile=work" + sep + "AWS_PROFILE=other" + sep +
                    "[default]\naws_access_key_id = AKIDDEFAULT\naws_secret_access_key = defaultsecret\n"
                    "[work]\naws_access_key_id=AKIDWORK\naws_secret_access_key=worksecret\n"
                    "aws_session_token = worktoken\n" + sep +
                    "[profile work]\nregion = us-west-2\nendpoint_url = http://minio:9000\ns3 =\n"
                    "  addressing_style = path\n  endpoint_url = http://s3.minio:9000\n; comment\n# comment\n",
        "profile_default_config": "s" + "s3://bkt" + sep + "" + sep + "" + sep +
                                  "[default]\nregion=default\ns3 =\n addressing_style = virtual\n",
        "bad_query": "s" + "s3://bkt?part_size=0&part_size=1&x=%zz#frag",
        "open_file": "o" + "file:///tmp/dcr-fuzz-nonexistent/a%20b/../c",
        "open_localhost": "o" + "file://localhost/tmp",
        "open_mem": "o" + "mem://fuzz-name",
        "open_path": "o" + "relative/path",
        "open_unknown": "o" + "gs://bucket/x",
        "faults": "f" + "seed=1,fail=0.1,lost=0.05,delay_ms=5,mbps=100",
        "faults_bad": "f" + "seed=1e30,delay_ms=nan,mbps=-1,fail=2",
    }
    return {name: text.encode() for name, text in seeds.items()}


def layout_map_seeds(dcr=None):
    def doc(tensors, buffers, copies, **extra):
        d = {"format": "dcr-layout", "format_version": 1, "tensors": tensors, "buffers": buffers, "copies": copies}
        d.update(extra)
        return json.dumps(d)

    t = [{"name": "w", "dtype": "BF16", "shape": [4, 6]}, {"name": "n", "dtype": "F32", "shape": [3]}]
    b = [{"id": "a", "dtype": "BF16", "shape": [2, 6]}, {"id": "s", "dtype": "BF16", "shape": [2, 2, 6]},
         {"id": "n0", "dtype": "F32", "shape": [3]}, {"id": "n1", "dtype": "F32", "shape": [3]}]
    c = [{"tensor": "w", "offset": [0, 0], "extent": [2, 6], "buffer": "a", "buffer_offset": [0, 0]},
         {"tensor": "w", "offset": [2, 0], "extent": [2, 6], "buffer": "s", "buffer_offset": [1, 0, 0]},
         {"tensor": "n", "offset": [0], "extent": [3], "buffer": "n0", "buffer_offset": [0]},
         {"tensor": "n", "offset": [0], "extent": [3], "buffer": "n1", "buffer_offset": [0], "primary": False}]
    cols = [{"tensor": "w", "offset": [0, 2 * i], "extent": [4, 2], "buffer": "c", "buffer_offset": [0, 2 * i]}
            for i in range(3)]
    seeds = {
        "good": doc(t, b, c),
        "columns": doc(t[:1], [{"id": "c", "dtype": "BF16", "shape": [4, 6]}], cols),
        "scalar": doc([{"name": "s", "dtype": "F8_E4M3", "shape": []}], [{"id": "x", "dtype": "F8_E4M3", "shape": [2]}],
                      [{"tensor": "s", "offset": [], "extent": [], "buffer": "x", "buffer_offset": [1]}]),
        "overlap": doc(t, b, c[:1] + [dict(c[1], buffer="a", buffer_offset=[0, 0])]),
        "two_primaries": doc(t, b, c[:3] + [dict(c[3], primary=True)]),
        "outside": doc(t, b, [dict(c[0], offset=[3, 0])]),
        "dtype_mismatch": doc(t, [dict(b[0], dtype="F16")] + b[1:], c),
        "sub_byte": doc([{"name": "f", "dtype": "F4", "shape": [4]}], [], []),
        "huge": doc([{"name": "h", "dtype": "U8", "shape": [2**63, 4]}], [{"id": "h", "dtype": "U8", "shape": [2**40]}], []),
        "empty": doc([], [], []),
        "bad_version": doc([], [], [], format_version=2),
    }
    # Generated maps (dcr layout generate), when the binary is given.
    # Small ones (2 experts, one of 2 pipeline stages: 6 KB; a llama rank: 9 KB): every
    # layer repeats the same kinds of copies, and larger inputs only slow each execution.
    for name, args in {"gen_megatron_deepseek": ["--side", "megatron", "--family", "deepseek-v3", "--tp", "2",
                                                 "--ep", "2", "--expert-tp", "--experts", "2", "--pp", "2"],
                       "gen_vllm_llama": ["--side", "vllm", "--family", "llama", "--tp", "2"]}.items():
        if dcr:
            seeds[name] = subprocess.run([dcr, "layout", "generate", "--size", "64KB"] + args, check=True,
                                         capture_output=True).stdout
    return seeds
def relay_head(t):
    """A relay wire message's 8-byte header of type t (docs/relay.md)."""
    import struct
    return struct.pack("<IBBH", 0x4C524344, 1, t, 0)


def s16(b):
    """A relay wire str16: u16 length, then the bytes."""
    import struct
    return struct.pack("<H", len(b)) + b


def first_frame(frame_dir):
    """The first of frame_fuzz's seeds (a valid frame), or b"" before they exist."""
    if os.path.isdir(frame_dir):
        names = sorted(os.listdir(frame_dir))
        if names:
            with open(os.path.join(frame_dir, names[0]), "rb") as f:
                return f.read()
    return b""


def relay_message_seeds(frame_dir):
    """Relay wire messages (docs/relay.md). The fuzz target's first byte
    picks the split: even, one part; odd, two parts cut at the offset in the
    next two bytes (little-endian)."""
    import struct
    head = relay_head
    key = b"attempts/v0000000001/0000-0123abcd/frames/s0-0000.bin"
    frame = first_frame(frame_dir)
    one = b"\x00\x00\x00"
    hello = (head(1) + bytes([2]) + s16(b"receiver-1") + struct.pack("<I", 2) + s16(key) +
             s16(key.replace(b"0000.bin", b"0001-t3c17.bin")))
    # The object's CRC is left 0: mutations that fix it reach the frame checks.
    obj = head(2) + s16(key) + struct.pack("<QI", len(frame), 0)
    return {
        "ping": one + head(5),
        "credit": one + head(3) + struct.pack("<QI", 1 << 20, 1),
        "fence": one + head(4) + s16(b"attempts/v0000000001/0000-0123abcd/"),
        "notice_attempt": one + head(7) + s16(b"attempts/v0000000001/0000-0123abcd/"),
        "notice_commit": one + head(7) + s16(b"commits/v0000000001.json"),
        "hello": one + hello,
        "object": b"\x01" + struct.pack("<H", len(obj)) + obj + frame,
        "ack": one + head(6) + s16(b"attempts/v0000000001/0000-0123abcd/") + struct.pack("<I", 2) +
               s16(b"e0") + bytes([1]) + struct.pack("<QQ", 7, 9) + s16(b"") +
               s16(b"e1") + bytes([0]) + struct.pack("<QQ", 0, 0) + s16(b"cannot apply"),
    }


def crc32c(data):
    """CRC-32C (Castagnoli), as the relay's OBJECT header carries it."""
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def relay_daemon_seeds(frame_dir):
    """Scripts for relay_daemon_fuzz (its header says the encoding): peers
    attach as senders, receivers and relays with their keys, send objects
    (valid CRC and frames), acks and fences, with turns of the loop between."""
    import struct
    head = relay_head
    frame = first_frame(frame_dir)
    prefix = b"attempts/v0000000001/0000-0123abcd/"

    def obj(name):
        key = prefix + b"frames/" + name
        return [head(2) + s16(key) + struct.pack("<QI", len(frame), crc32c(frame)), frame]

    def hello(role, rid, have=()):
        return [head(1) + bytes([role]) + s16(rid) + struct.pack("<I", len(have)) + b"".join(s16(h) for h in have)]

    ack = [head(6) + s16(prefix) + struct.pack("<I", 1) + s16(b"e0") + bytes([1]) + struct.pack("<QQ", 7, 9) + s16(b"")]
    fence = [head(4) + s16(prefix)]
    notice = [head(7) + s16(b"commits/v0000000001.json")]
    ping = [head(5)]
    S, R, C, A, X = 1, 2, 3, 4, 5  # key indices

    def peer(p, key, parts):
        if len(parts) == 1:
            return bytes([0, p | key << 2]) + struct.pack("<H", len(parts[0])) + parts[0]
        joined = parts[0] + parts[1]
        return bytes([1, p | key << 2, len(parts[0])]) + struct.pack("<H", len(joined)) + joined

    def up(parts):
        joined = b"".join(parts)
        return bytes([2, len(parts[0]) if len(parts) == 2 else 0]) + struct.pack("<H", len(joined)) + joined

    turn = b"\x03"
    def script(setup, *steps):
        return bytes([setup]) + b"".join(steps)

    return {
        "secure_round": script(1, peer(0, S, hello(3, b"pub")), peer(1, C, hello(2, b"e0")), peer(0, S, obj(b"s0-0000.bin")),
                               peer(0, S, obj(b"s0-0001.bin")), turn, peer(1, C, ack), turn, peer(0, S, fence), turn),
        "insecure_round": script(0, peer(1, 0, hello(2, b"e0")), peer(0, 0, hello(3, b"pub")),
                                 peer(0, 0, obj(b"s0-0000.bin")), turn, peer(1, 0, ping), peer(1, 0, ack), turn),
        "roles_refused": script(1, peer(0, C, hello(3, b"fake")), peer(0, C, obj(b"s0-0000.bin")), peer(1, X, hello(2, b"x")),
                                peer(2, R, hello(2, b"e0")), peer(3, A, hello(1, b"relay-2")), peer(2, C, hello(2, b"e0")), turn),
        "upstream_verify": script(1 | 2 | 4, peer(1, C, hello(2, b"e0", [prefix + b"frames/s0-0002.bin"])), up(obj(b"s0-0000.bin")),
                                  up(obj(b"s0-0001.bin")), turn, peer(1, C, ack), turn, up(fence), turn),
        # Notices go down from senders and the upstream; a receiver's is refused.
        "notices": script(1 | 2 | 4, peer(1, C, hello(2, b"e0")), peer(0, S, hello(3, b"pub")), peer(0, S, notice),
                          up(notice), peer(1, C, notice), turn),
        # A peer that says HELLO again under new ids: each old id's link counters must be let go.
        "sender_new_ids": script(8, *[peer(0, 0, hello(3, b"s%d" % n)) for n in range(12)]),
        "child_new_ids": script(8, *[peer(0, 0, hello(2, b"e%d" % n)) for n in range(12)], turn),
        "tight_limits": script(8, *[peer(p, 0, hello(2, b"e%d" % p)) for p in range(3)],
                               *[peer(p, 0, hello(3, b"s%d" % p)) for p in (2, 3)], peer(3, 0, hello(3, b"s4")),
                               *[peer(3, 0, obj(b"s3-%04d.bin" % n)) for n in range(24)], turn, turn),
    }


def records_seeds():
    """The protocol's store records (docs/protocol.md); byte 0 picks the parser:
    0 run, 1 commit, 2 ack, 3 receiver, 4 snapshot, 5 trainer process, 6 attempt, 7 fence, 8 timeline."""
    import json
    d = "0123456789abcdef" * 2
    recs = {
        "run": (0, {"format": "dcr-run", "run_id": "r-1", "chunk_elements": 1048576,
                    "tensors": [{"name": "w", "dtype": "BF16", "shape": [2, 3]}]}),
        "run_fp8": (0, {"format": "dcr-run", "format_version": 2, "run_id": "r-2", "chunk_elements": 1048576,
                        "tensors": [{"name": "w", "dtype": "BF16", "shape": [2, 3]}],
                        "fp8": {"format": "e4m3fn", "block_rows": 128, "block_cols": 128, "scale": "amax / 448",
                                "rounding": "nearest even", "specials": "saturate"}}),
        "commit": (1, {"format": "dcr-commit", "version": 2, "base_version": 1, "attempt": "0001-0123abcd",
                       "target_digest": d, "acked": ["e0", "e1"], "retired": [], "time": 1764648000.25}),
        "commit_memory": (1, {"format": "dcr-commit", "version": 3, "base_version": 2, "attempt": "0000-0123abcd",
                              "target_digest": d, "acked": ["e0"], "retired": [], "time": 1764648001.25,
                              "publisher_memory": {"baseline_bytes": 2097152, "baseline_in_memory": True,
                                                   "staging_bytes": 0, "frames_in_flight_bytes": 65536,
                                                   "digest_bytes": 64}}),
        "ack": (2, {"format": "dcr-ack", "receiver": "e0", "ok": True, "digest": d, "error": ""}),
        "ack_rank": (2, {"format": "dcr-ack", "receiver": "eng-r1", "ok": True, "digest": d, "error": "",
                         "engine": {"id": "eng", "rank": 1, "ranks": 2}}),
        "ack_spans": (2, {"format": "dcr-ack", "receiver": "e2", "ok": True, "digest": d, "error": "",
                          "spans": [{"stage": "download", "start": 1764648000.25, "end": 1764648000.5},
                                    {"stage": "ack", "start": 1764648000.75, "end": 1764648000.75}]}),
        "timeline": (8, {"format": "dcr-timeline", "process": "host-1", "role": "publisher", "version": 3,
                         "total_seconds": 0.75,
                         "spans": [{"stage": "encode", "start": 1764648000.0, "end": 1764648000.5}]}),
        "nack": (2, {"format": "dcr-ack", "receiver": "e1", "ok": False, "digest": d, "error": "corrupt frame"}),
        "receiver": (3, {"format": "dcr-receiver", "id": "e0", "state": "following", "version": 3,
                         "heartbeat": 1764648000.5, "frames_held_bytes": 40960,
                         "master_bytes": 1048576, "verified_digest": d, "verified_at": 1764647999.75}),
        "receiver_rank": (3, {"format": "dcr-receiver", "id": "eng-r0", "state": "applying", "version": 3,
                              "heartbeat": 1764648001.0, "engine": {"id": "eng", "rank": 0, "ranks": 4}}),
        "attempt": (6, {"format": "dcr-attempt", "version": 3, "class": "xor", "delta_id": "0123456789abcdef",
                        "object_key": "ab" * 32, "coordinator": "host:1", "time": 1764648002.5}),
        "attempt_procs": (6, {"format": "dcr-attempt", "version": 3, "class": "overwrite",
                              "delta_id": "00000000000000ff", "coordinator": "host:2", "processes": 2, "senders": 4,
                              "time": 1764648003.0}),
        "snapshot": (4, {"format": "dcr-snapshot", "version": 0, "digest": d,
                         "files": [{"name": "model.safetensors", "bytes": 4096}]}),
        "fence": (7, {"format": "dcr-fence", "reason": "UNAVAILABLE: the store did not answer", "time": 1.8e9}),
        "process": (5, {"format": "dcr-process", "attempt": "0000-0123abcd", "process": 1, "processes": 3,
                        "senders": [1, 2], "baseline_digest": d, "target_digest": d,
                        "objects": ["frames/s1-0000.bin"],
                        "frames": [[0, 0, 0, 0, 120, "xor", "sparse", 3], [0, 2, 0, 120, 200, "add", "zstd", 9]],
                        "chunks": [[0, 0, d, d], [0, 1, d, d], [0, 2, d, d]]}),
        "process_empty": (5, {"format": "dcr-process", "attempt": "0001-0123abcd", "process": 0, "processes": 1,
                              "senders": [0], "baseline_digest": d, "target_digest": d, "objects": [],
                              "frames": [], "chunks": []}),
    }
    return {name: bytes([t]) + json.dumps(doc).encode() for name, (t, doc) in recs.items()}


def contribution_seeds():
    """Contribution objects (docs/format.md section 5) for contribution_fuzz's
    fixed delta: tensor 0 "a" F32 [12, 10], tensor 1 "b" BF16 [20], chunks of
    16. Byte 0: bit 0 overwrite class, bit 1 the writer also holds sender 1,
    bit 2 recompute the checksum (written here as zeros)."""
    def obj(cls, records):
        body = b""
        for tensor, chunk, sender, ranges, positions, eb, covered_bits in records:
            body += struct.pack("<6I", tensor, chunk, sender, len(ranges), len(positions), 0)
            body += struct.pack("<2Q", 12345, 67890)
            for lo, n in ranges:
                body += struct.pack("<2I", lo, n)
            for p in positions:
                body += struct.pack("<I", p)
            body += bytes(range(len(positions) * eb)) + bytes(reversed(range(len(positions) * eb)))
            if cls == 2:
                body += bytes((7 * i) & 0xFF for i in range(sum(n for _, n in ranges) * eb))
        head = b"DCRCONTR" + struct.pack("<2IQ2I2Q", 1, cls, 0x1234, 1, 0, len(records), len(body))
        return head + body + b"\0" * 8
    recs = [(0, 0, 0, [(0, 5), (10, 5)], [1, 4, 12], 4, True), (0, 1, 0, [(4, 5), (14, 2)], [], 4, True),
            (1, 1, 1, [(0, 4)], [0, 3], 2, True)]
    out = {}
    for cls, name in ((1, "xor"), (2, "overwrite")):
        flag = 0 if cls == 1 else 1
        out[f"{name}-one"] = bytes([flag | 4]) + obj(cls, recs[:1])
        out[f"{name}-three"] = bytes([flag | 2 | 4]) + obj(cls, recs)
        out[f"{name}-empty"] = bytes([flag | 4]) + obj(cls, [])
        out[f"{name}-unsealed"] = bytes([flag]) + obj(cls, recs[:2])
    return out


def journals_seeds():
    """The receivers' local journals (src/receiver/journals.h); byte 0 picks the
    parser: 0 .dcr-follow.json, 1 .dcr-rank.json, 2 .dcr-rank-frames."""
    import json
    d, e = "0123456789abcdef" * 2, "00000000000000010000000000000002"
    follow = {"run_id": "r-1", "receiver": "e0", "version": 3, "attempt": "0001-0123abcd"}
    rank = {"run_id": "r-1", "receiver": "eng-r1", "engine": "eng", "rank": 1, "ranks": 2, "version": 3,
            "digest": d, "attempt": "0001-0123abcd", "attempt_state": "applying", "attempt_digest": e}
    log = "dcr-rank-frames 0001-0123abcd\n" + f"b 0 0 {d}\nb 2 7 {e}\nt 0 0 {e}\n"
    return {
        "follow": bytes([0]) + json.dumps(follow).encode(),
        "follow_idle": bytes([0]) + json.dumps(dict(follow, attempt="")).encode(),
        "rank": bytes([1]) + json.dumps(rank).encode(),
        "rank_joining": bytes([1]) + json.dumps(dict(rank, attempt="snapshot", attempt_state="")).encode(),
        "frames": bytes([2]) + log.encode(),
        "frames_torn": bytes([2]) + (log + "b 3 1 0123").encode(),
        "frames_header_only": bytes([2]) + b"dcr-rank-frames 0001-0123abcd\n",
    }


def http_request_seeds():
    """The metrics endpoint's parsers (include/dcr/metrics.h); byte 0 picks
    the parser: 0 a request head, 1 a HOST:PORT address."""
    return {
        "scrape": b"\0GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:9400\r\nAccept: text/plain\r\n\r\n",
        "head_query": b"\0HEAD /metrics?name[]=x HTTP/1.0\r\n\r\n",
        "no_blank_line": b"\0GET /metrics HTTP/1.1\r\nHost: x\r\n",
        "bad_header": b"\0GET / HTTP/1.1\r\nA b: c\r\n\r\n",
        "address": b"\1127.0.0.1:9400",
        "address_v6": b"\1[::1]:0",
        "address_bad": b"\1::1:99999",
    }


def write_all(out_dir, seeds):
    os.makedirs(out_dir, exist_ok=True)
    for name, blob in seeds.items():
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(blob.encode() if isinstance(blob, str) else blob)


def main():
    out = os.path.join(sys.argv[1], "safetensors_header_fuzz")
    os.makedirs(out, exist_ok=True)
    delta_seeds(sys.argv[2], os.path.join(sys.argv[1], "frame_fuzz"), os.path.join(sys.argv[1], "manifest_fuzz"))
    seeds = {
        "empty_header": safetensors([]),
        "one_bf16": safetensors([("w", "BF16", [2, 3], 12)]),
        "metadata": safetensors([("a", "F32", [4], 16)], metadata={"format": "pt"}),
        "all_dtypes": safetensors([
            ("b", "BOOL", [3], 3), ("u8", "U8", [2], 2), ("i8", "I8", [2], 2), ("i16", "I16", [2], 4),
            ("u16", "U16", [1], 2), ("f16", "F16", [2], 4), ("bf", "BF16", [2], 4), ("i32", "I32", [1], 4),
            ("u32", "U32", [1], 4), ("f32", "F32", [1], 4), ("f64", "F64", [1], 8), ("i64", "I64", [1], 8),
            ("u64", "U64", [1], 8), ("c64", "C64", [1], 8), ("e4", "F8_E4M3", [2], 2),
            ("e5", "F8_E5M2", [2], 2), ("e8", "F8_E8M0", [1], 1), ("e4u", "F8_E4M3FNUZ", [1], 1),
            ("e5u", "F8_E5M2FNUZ", [1], 1), ("f4", "F4", [4], 2), ("f6a", "F6_E2M3", [4], 3),
            ("f6b", "F6_E3M2", [4], 3)]),
        "scalar_and_empty": safetensors([("s", "F32", [], 4), ("z", "F16", [0, 5], 0)]),
        "unpadded": safetensors([("w", "I64", [1], 8)], pad=False),
        "trailing": safetensors([("w", "U8", [1], 1)], data_extra=b"x"),
        "truncated": safetensors([("w", "F64", [4], 32)])[:-5],
    }
    for name, blob in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(blob)
    write_all(os.path.join(sys.argv[1], "s3_xml_fuzz"), S3_XML)
    write_all(os.path.join(sys.argv[1], "s3_response_fuzz"), s3_response_seeds())
    write_all(os.path.join(sys.argv[1], "store_config_fuzz"), store_config_seeds())
    write_all(os.path.join(sys.argv[1], "layout_map_fuzz"), layout_map_seeds(sys.argv[2]))
    write_all(os.path.join(sys.argv[1], "records_fuzz"), records_seeds())
    write_all(os.path.join(sys.argv[1], "contribution_fuzz"), contribution_seeds())
    write_all(os.path.join(sys.argv[1], "journals_fuzz"), journals_seeds())
    write_all(os.path.join(sys.argv[1], "http_request_fuzz"), http_request_seeds())
    write_all(os.path.join(sys.argv[1], "relay_message_fuzz"), relay_message_seeds(os.path.join(sys.argv[1], "frame_fuzz")))
    write_all(os.path.join(sys.argv[1], "relay_daemon_fuzz"), relay_daemon_seeds(os.path.join(sys.argv[1], "frame_fuzz")))


if __name__ == "__main__":
    main()
