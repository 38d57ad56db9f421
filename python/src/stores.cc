// dcr._dcr: object stores.
#include "bindings.h"

namespace dcr_python {

// Store: put, get, head, list, delete.
void BindStores(nb::module_& m) {
  nb::class_<PyStore>(m, "Store")
      .def_prop_ro("url", [](const PyStore& s) { return s.store->url(); })
      .def(
          "put",
          [](PyStore& s, const std::string& key, nb::bytes data, bool create_if_absent) {
            dcr::Status st;
            {
              nb::gil_scoped_release release;
              st = s.store->Put(key, std::string_view(data.c_str(), data.size()),
                                create_if_absent ? dcr::WriteMode::kCreateIfAbsent : dcr::WriteMode::kOverwrite);
            }
            Check(st);
          },
          "key"_a, "data"_a, "create_if_absent"_a = false)
      .def(
          "get",
          [](PyStore& s, const std::string& key) {
            dcr::Result<std::string> r = dcr::Internal("not run");
            {
              nb::gil_scoped_release release;
              r = s.store->Get(key);
            }
            std::string v = Take(std::move(r));
            return nb::bytes(v.data(), v.size());
          },
          "key"_a)
      .def(
          "head",
          [](PyStore& s, const std::string& key) {
            dcr::Result<dcr::ObjectInfo> r = dcr::Internal("not run");
            {
              nb::gil_scoped_release release;
              r = s.store->Head(key);
            }
            dcr::ObjectInfo i = Take(std::move(r));
            return nb::make_tuple(i.key, i.size, i.etag);
          },
          "key"_a)
      .def(
          "list",
          [](PyStore& s, const std::string& prefix) {
            dcr::Result<std::vector<dcr::ObjectInfo>> r = dcr::Internal("not run");
            {
              nb::gil_scoped_release release;
              r = s.store->List(prefix);
            }
            std::vector<nb::tuple> out;
            for (const auto& i : Take(std::move(r))) out.push_back(nb::make_tuple(i.key, i.size, i.etag));
            return out;
          },
          "prefix"_a = "")
      .def(
          "delete",
          [](PyStore& s, const std::string& key) {
            dcr::Status st;
            {
              nb::gil_scoped_release release;
              st = s.store->Delete(key);
            }
            Check(st);
          },
          "key"_a);
}

// open_store, and where a publisher keeps its state.
void BindStoreFunctions(nb::module_& m) {
  m.def(
      "default_publisher_state_dir",
      [](const std::string& store_url) { return Take(dcr::DefaultPublisherStateDir(store_url)); }, "store_url"_a);
  m.def(
      "open_store",
      [](const std::string& url, bool create_root) {
        dcr::OpenStoreOptions o;
        o.create_root = create_root;
        dcr::Result<std::unique_ptr<dcr::Store>> r = dcr::Internal("not run");
        {
          nb::gil_scoped_release release;
          r = dcr::OpenStore(url, o);
        }
        return new PyStore{Take(std::move(r))};
      },
      "url"_a, "create_root"_a = true, nb::rv_policy::take_ownership);
}

}  // namespace dcr_python
