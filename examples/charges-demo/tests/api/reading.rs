//! Retrieving and listing charges: scoped per account, paged, parameters checked.

use axum::http::StatusCode;

use crate::common::{Backend, Harness, charge, get, new_api_key, new_key};

on_every_backend!(
    retrieve_and_list_are_scoped_per_account,
    list_pages_and_validates_its_parameters,
);

async fn retrieve_and_list_are_scoped_per_account(backend: Backend) {
    let h = Harness::start(backend).await;
    let alice = new_api_key();
    let bob = new_api_key();
    let mut alices = Vec::new();
    for amount in [100, 200, 300] {
        let reply = h
            .send(charge(
                &alice,
                Some(&new_key()),
                &format!("amount={amount}&currency=usd"),
            ))
            .await;
        assert_eq!(reply.status, StatusCode::OK);
        alices.push(reply.json()["id"].as_str().unwrap().to_owned());
    }
    let reply = h
        .send(charge(&bob, Some(&new_key()), "amount=999&currency=usd"))
        .await;
    let bobs = reply.json()["id"].as_str().unwrap().to_owned();

    // Bob cannot see Alice's charge, and cannot tell it exists.
    let foreign = h
        .send(get(&bob, &format!("/v1/charges/{}", alices[0])))
        .await;
    let error = foreign.stripe_error(StatusCode::NOT_FOUND, "invalid_request_error");
    assert_eq!(error["code"], "resource_missing");
    let missing = h.send(get(&bob, "/v1/charges/ch_doesnotexist")).await;
    let missing_error = missing.stripe_error(StatusCode::NOT_FOUND, "invalid_request_error");
    assert_eq!(
        error["message"].as_str().unwrap().replace(&alices[0], "ID"),
        missing_error["message"]
            .as_str()
            .unwrap()
            .replace("ch_doesnotexist", "ID"),
        "a foreign charge and a missing one look the same"
    );

    // Each list holds its own charges only, newest first.
    let ids = |charges: Vec<serde_json::Value>| -> Vec<String> {
        charges
            .iter()
            .map(|c| c["id"].as_str().unwrap().to_owned())
            .collect()
    };
    let mut expected = alices.clone();
    expected.reverse();
    assert_eq!(ids(h.charges_of(&alice).await), expected);
    assert_eq!(ids(h.charges_of(&bob).await), [bobs.as_str()]);

    // A cursor of another account's is refused.
    let cursor = h
        .send(get(&alice, &format!("/v1/charges?starting_after={bobs}")))
        .await;
    let error = cursor.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
    assert_eq!(error["param"], "starting_after");
}

async fn list_pages_and_validates_its_parameters(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let mut ids = Vec::new();
    for amount in 1..=5 {
        let reply = h
            .send(charge(
                &api_key,
                Some(&new_key()),
                &format!("amount={amount}&currency=usd"),
            ))
            .await;
        ids.push(reply.json()["id"].as_str().unwrap().to_owned());
    }
    ids.reverse(); // newest first

    let page = h.send(get(&api_key, "/v1/charges?limit=2")).await;
    assert_eq!(page.status, StatusCode::OK);
    let list = page.json();
    assert_eq!(list["object"], "list");
    assert_eq!(list["url"], "/v1/charges");
    assert_eq!(list["has_more"], true);
    let data = list["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(data[0]["id"], ids[0]);
    assert_eq!(data[1]["id"], ids[1]);
    assert_eq!(data[0]["object"], "charge");

    let next = h
        .send(get(
            &api_key,
            &format!("/v1/charges?limit=2&starting_after={}", ids[3]),
        ))
        .await
        .json();
    assert_eq!(next["has_more"], false);
    assert_eq!(next["data"].as_array().unwrap().len(), 1);
    assert_eq!(next["data"][0]["id"], ids[4]);

    let default = h.send(get(&api_key, "/v1/charges")).await.json();
    assert_eq!(default["data"].as_array().unwrap().len(), 5);
    assert_eq!(default["has_more"], false);

    for query in ["limit=0", "limit=101", "limit=ten"] {
        let reply = h.send(get(&api_key, &format!("/v1/charges?{query}"))).await;
        let error = reply.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
        assert_eq!(error["param"], "limit", "{query}");
    }
    let reply = h.send(get(&api_key, "/v1/charges?customer=cus_1")).await;
    let error = reply.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
    assert_eq!(error["code"], "parameter_unknown");
}
