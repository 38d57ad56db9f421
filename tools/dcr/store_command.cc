// dcr store ls | put | get | cat | rm: look at and move objects in any store.
#include <fmt/format.h>

#include <cstdio>
#include <iostream>

#include "cli.h"
#include "dcr/mapped_file.h"
#include "dcr/progress.h"
#include "dcr/store.h"

namespace dcr::cli {
namespace {

struct StoreArgs {
  std::string url, key, file, prefix;
};

constexpr uint64_t kBlock = 16u << 20;

int Ls(const StoreArgs& a) {
  auto store = OpenStore(a.url);
  if (!store.ok()) return Fail("store ls", store.status());
  auto list = (*store)->List(a.prefix);
  if (!list.ok()) return Fail("store ls", list.status());
  uint64_t total = 0;
  for (const auto& o : *list) {
    fmt::print("{:>12}  {}\n", o.size, o.key);
    total += o.size;
  }
  fmt::print("{} objects, {}\n", list->size(), FormatBytes(total));
  return kExitOk;
}

int Put(const StoreArgs& a) {
  auto store = OpenStore(a.url);
  if (!store.ok()) return Fail("store put", store.status());
  auto file = MappedFile::Open(a.file, false);
  if (!file.ok()) return Fail("store put", file.status());
  auto writer = (*store)->OpenWriter(a.key, WriteMode::kOverwrite);
  if (!writer.ok()) return Fail("store put", writer.status());
  Progress progress("store put " + a.key, file->size());
  for (uint64_t off = 0; off < file->size(); off += kBlock) {
    const uint64_t n = std::min<uint64_t>(kBlock, file->size() - off);
    if (Status s = (*writer)->Write(file->data().subspan(off, n)); !s.ok()) return Fail("store put", s);
    progress.Add(n);
  }
  if (Status s = (*writer)->Close(); !s.ok()) return Fail("store put", s);
  return kExitOk;
}

// Streams the object to `out` in blocks of one version (if-match).
Status Copy(Store& store, const std::string& key, std::FILE* out) {
  DCR_ASSIGN_OR_RETURN(ObjectInfo head, store.Head(key));
  std::vector<uint8_t> block(std::min<uint64_t>(kBlock, head.size));
  Progress progress("store get " + key, head.size);
  for (uint64_t off = 0; off < head.size; off += kBlock) {
    const uint64_t n = std::min<uint64_t>(kBlock, head.size - off);
    DCR_RETURN_IF_ERROR(store.ReadRange(key, off, {block.data(), n}, {.if_match = head.etag}));
    if (std::fwrite(block.data(), 1, n, out) != n) return ErrnoError(errno, "cannot write the output");
    progress.Add(n);
  }
  return Status::Ok();
}

int Get(const StoreArgs& a, bool to_stdout) {
  const std::string cmd = to_stdout ? "store cat" : "store get";
  auto store = OpenStore(a.url);
  if (!store.ok()) return Fail(cmd, store.status());
  if (to_stdout) {
    Status s = Copy(**store, a.key, stdout);
    return s.ok() ? kExitOk : Fail(cmd, s);
  }
  const std::string part = a.file + ".dcr-part";
  std::FILE* out = std::fopen(part.c_str(), "wb");
  if (!out) return Fail(cmd, ErrnoError(errno, "cannot create " + part));
  Status s = Copy(**store, a.key, out);
  if (std::fclose(out) != 0 && s.ok()) s = ErrnoError(errno, "cannot write " + part);
  if (s.ok() && std::rename(part.c_str(), a.file.c_str()) != 0) s = ErrnoError(errno, "cannot rename " + part);
  if (!s.ok()) {
    std::remove(part.c_str());
    return Fail(cmd, s);
  }
  return kExitOk;
}

int Rm(const StoreArgs& a) {
  auto store = OpenStore(a.url);
  if (!store.ok()) return Fail("store rm", store.status());
  Status s = (*store)->Delete(a.key);
  return s.ok() ? kExitOk : Fail("store rm", s);
}

}  // namespace

void AddStoreCommand(CLI::App& app) {
  auto* store =
      app.add_subcommand("store", "List, upload, download and delete objects of a store (file://, s3://, mem://)");
  store->require_subcommand(1);
  auto a = std::make_shared<StoreArgs>();
  auto* ls = store->add_subcommand("ls", "List objects (sizes and keys) under a prefix");
  ls->add_option("url", a->url, "Store URL")->required();
  ls->add_option("prefix", a->prefix, "Key prefix");
  ls->callback([a] { ExitCode() = Ls(*a); });
  auto* put = store->add_subcommand("put", "Upload a file as an object (streamed)");
  put->add_option("url", a->url, "Store URL")->required();
  put->add_option("key", a->key, "Object key")->required();
  put->add_option("file", a->file, "Local file")->required();
  put->callback([a] { ExitCode() = Put(*a); });
  auto* get = store->add_subcommand("get", "Download an object into a file");
  get->add_option("url", a->url, "Store URL")->required();
  get->add_option("key", a->key, "Object key")->required();
  get->add_option("file", a->file, "Local file")->required();
  get->callback([a] { ExitCode() = Get(*a, false); });
  auto* cat = store->add_subcommand("cat", "Write an object to stdout");
  cat->add_option("url", a->url, "Store URL")->required();
  cat->add_option("key", a->key, "Object key")->required();
  cat->callback([a] { ExitCode() = Get(*a, true); });
  auto* rm = store->add_subcommand("rm", "Delete an object (no error if absent)");
  rm->add_option("url", a->url, "Store URL")->required();
  rm->add_option("key", a->key, "Object key")->required();
  rm->callback([a] { ExitCode() = Rm(*a); });
}

}  // namespace dcr::cli
